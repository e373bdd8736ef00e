"""The `skvs` command line: version, help, and the allocator and scheduler micro-benchmarks at a tiny size."""

import re
import subprocess
import sys

import pytest

from skvs_jax import __version__, cli


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and __version__ in capsys.readouterr().out
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert __version__ in out and "micro" in out


def test_micro_allocator_small_run_prints_its_ratios(capsys):
    argv = "micro allocator --seqs 8 --blocks 512 --max-blocks-per-seq 64 --steps 4 --steps-per-call 2"
    assert cli.main(argv.split() + ["--dispatch-steps", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "identical states" in "\n".join(lines)  # the run checks the batched allocator against the oracle
    assert re.fullmatch(r"allocator speedup vs sequential jax search: [0-9.]+x", lines[-2])
    assert re.fullmatch(r"allocator speedup vs python oracle: [0-9.]+x", lines[-1])


def test_micro_scheduler_small_run_prints_its_ratio(capsys):
    argv = ("micro scheduler --seqs 8 --blocks 512 --max-blocks-per-seq 16 --prompt-len 24 --calls 1 "
            "--steps-per-call 2")
    assert cli.main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "identical states: True" in out and "allocation always ok: True" in out
    assert re.fullmatch(r"scheduler speedup vs python oracle: [0-9.]+x", out.strip().splitlines()[-1])


def test_generate_streams_a_continuation(capsys):
    assert cli.main(["generate", "Return the number of ", "--max-tokens", "12", "--plain"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Return the number of ") and "-- 12 tokens in" in out and "policy skvs" in out
    assert cli.main(["generate", ""]) == 2


def test_console_script_entry_point_is_installed():
    out = subprocess.run([sys.executable, "-m", "skvs_jax.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and __version__ in out.stdout
