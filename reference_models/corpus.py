"""The training corpus: docstrings of the CPython 3.11 standard library, shipped xz-compressed.

Source: every module, class and function docstring (ASCII, longer than 40 characters) of the top-level
`Lib/*.py` files of CPython 3.11.7, in file order, separated by blank lines. The docstrings are part of
CPython and are distributed under the Python Software Foundation License Version 2, which permits
redistribution with the licence notice (https://docs.python.org/3/license.html); this file is that notice's
pointer. `python -m reference_models.corpus` rebuilds the file from the running interpreter's stdlib.

The text is split by document: the last `HELDOUT_FRACTION` of the docstrings is held out (never trained on)
and used to measure perplexity and Medusa acceptance.
"""

from __future__ import annotations

import ast
import lzma
import pathlib
import sysconfig

import numpy as np

CORPUS_PATH = pathlib.Path(__file__).parent / "data" / "stdlib_docstrings.txt.xz"
SEPARATOR = "\n\n"
HELDOUT_FRACTION = 0.05


def extract_docstrings(stdlib: pathlib.Path | None = None) -> list[str]:
    """Docstrings of the top-level modules of a CPython stdlib directory, in file and tree-walk order."""
    root = pathlib.Path(stdlib or sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40 and doc.isascii():
                    docs.append(doc)
    return docs


def load_documents() -> list[str]:
    """The shipped docstrings, one string per document."""
    text = lzma.decompress(CORPUS_PATH.read_bytes()).decode("ascii")
    return text.split(SEPARATOR + "\x1e")


def train_heldout_split() -> tuple[np.ndarray, np.ndarray]:
    """(train bytes [n_train] uint8, held-out bytes [n_heldout] uint8), split by document."""
    docs = load_documents()
    cut = int(len(docs) * (1.0 - HELDOUT_FRACTION))
    encode = lambda ds: np.frombuffer(SEPARATOR.join(ds).encode("ascii"), dtype=np.uint8)  # noqa: E731
    return encode(docs[:cut]), encode(docs[cut:])


def main() -> None:
    docs = extract_docstrings()
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    # "\x1e" (record separator) marks document boundaries so the split is exact; it never occurs in the text.
    CORPUS_PATH.write_bytes(lzma.compress((SEPARATOR + "\x1e").join(docs).encode("ascii"), preset=9))
    print(f"wrote {len(docs)} docstrings to {CORPUS_PATH} ({CORPUS_PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
