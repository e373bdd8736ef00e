"""`skvs gpu-check`, the project's one GPU script, exercised on this CPU (`--cpu-smoke`); never a GPU figure."""

import pytest

from skvs_jax import commands
from skvs_jax.commands import gpu_check, micro_host


def test_without_a_gpu_it_says_so_and_checks_nothing(capsys):
    assert commands.main(["gpu-check"]) == 2
    assert "no GPU visible" in capsys.readouterr().out


def test_it_refuses_an_unknown_section():
    with pytest.raises(SystemExit, match="unknown section"):
        commands.main(["gpu-check", "--cpu-smoke", "--only", "kernels,bogus"])


def test_the_kernels_section_runs_end_to_end_on_the_cpu(capsys):
    assert commands.main(["gpu-check", "--cpu-smoke", "--only", "kernels"]) == 0
    out = capsys.readouterr().out
    assert "== kernels: ok" in out and "FAIL" not in out and "all sections passed" in out


def test_the_serving_section_prints_every_figure_from_the_measurement(capsys, monkeypatch):
    """The section's report from `micro_host.measure`'s rows (stubbed here: the real run is the slow test below):
    per configuration throughput, dispatches per request, idle per step; the N / 1 and skvs / naive_spec ratios."""
    def rows(r):
        return [dict(wall_s=1.0, device_s=0.9, host_share=0.1, visible=0.1, serial_s=1.1, sent=r, steps=100,
                     dispatches=r, per_request=r / 32, host_ms_per_step=1.0, tok_s=1000.0 * (2 if r < 50 else 1),
                     same_steps=True)]

    fake = {f"{p} N={n}": rows(100 if n == 1 else 20) for p in ("naive_spec", "skvs") for n in (1, "auto")}
    monkeypatch.setattr(micro_host, "measure", lambda *a, **k: fake)
    monkeypatch.setattr(gpu_check, "_round_trips", lambda name, smoke: f"{name}: width 5: 3 while, 2 cond")
    monkeypatch.setattr(gpu_check.jax, "default_backend", lambda: "gpu")
    assert commands.main(["gpu-check", "--only", "serving"]) == 0
    out = capsys.readouterr().out
    assert "skvs N=auto" in out and "1000" in out and "naive_spec: N=auto / N=1 throughput 2.000x" in out
    assert "skvs / naive_spec at N=1: 1.000x" in out and "skvs: width 5: 3 while, 2 cond" in out


def test_control_flow_counts_every_while_and_cond_inside_a_program():
    import jax
    import jax.numpy as jnp

    def f(x):
        def body(c):
            return jax.lax.cond(c[0] > 2, lambda v: (v[0] + 1, v[1] * 2), lambda v: (v[0] + 1, v[1]), c)

        y = jax.lax.while_loop(lambda c: c[0] < 5, body, (x, x))[1]
        return jax.jit(lambda z: jax.lax.cond(z > 0, jnp.sin, jnp.cos, z))(y)

    assert gpu_check.control_flow(jax.make_jaxpr(f)(1.0)) == {"while": 1, "cond": 2}


@pytest.mark.slow  # compiles the engine at two steps per dispatch (~3 min here)
def test_the_whole_script_runs_end_to_end_on_the_cpu(capsys):
    assert commands.main(["gpu-check", "--cpu-smoke"]) == 0
    out = capsys.readouterr().out
    assert "== serving: ok" in out and "skvs: N=auto / N=1 throughput" in out


def test_micro_program_prints_the_counts_of_each_target(capsys):
    """`skvs micro program` (what the program section's counts come from), traced only: one policy, the small size."""
    assert commands.main(["micro", "program", "--policies", "skvs", "--sizes", "small", "--no-compile",
                          "--no-step"]) == 0
    out = capsys.readouterr().out
    assert "skvs / cpu" in out and "skvs / gpu" in out and "skvs: gpu / cpu heavy primitives" in out
    with pytest.raises(SystemExit, match="--sizes"):
        commands.main(["micro", "program", "--sizes", "huge"])
