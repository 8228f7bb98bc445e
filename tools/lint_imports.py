"""Check the import layering of the whole package with import-linter (``lint-imports``).

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``). One import namespace,
``spin_cluster``, spans four folders (``spin_cluster/``, ``kernels/``, ``deployments/``,
``profiling/``; see ``[tool.setuptools.package-dir]``), and grimp, import-linter's graph
builder, scans only the folder a package is found in. So this stages the namespace as one
tree of symbolic links (grimp follows them) and runs ``lint-imports`` over it:

    python tools/lint_imports.py            # the repository's own sources
    python tools/lint_imports.py --root R   # another copy (the test that breaks a layer)

Exit status: lint-imports' own (0 when every contract is kept).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def stage(root: Path, into: Path) -> Path:
    """``into/spin_cluster``: links to ``root/spin_cluster``'s entries and the mapped folders."""
    pkg = into / "spin_cluster"
    pkg.mkdir(parents=True)
    for entry in (root / "spin_cluster").iterdir():
        if entry.name != "__pycache__" and not entry.name.endswith(".egg-info"):
            os.symlink(entry.resolve(), pkg / entry.name)
    mapped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in mapped.items():  # "spin_cluster.kernels" = "kernels", ...
        if name != "spin_cluster":
            os.symlink((root / folder).resolve(), pkg / name.removeprefix("spin_cluster."))
    return pkg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="repository copy to check (default: this one)")
    args = parser.parse_args(argv)
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        print("error: lint-imports not found next to this Python; install the test extra "
              "(pip install -e '.[test]')", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spin-lint-") as tmp:
        stage(args.root, Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        cmd = [str(lint), str(args.root / "pyproject.toml"), "--no-cache"]
        # cwd: the staged tree, so grimp finds it before the installed (editable) package.
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
