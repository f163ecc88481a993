"""The docs stand alone: the README's configuration table lists exactly the keys of
``dask-config.yaml`` (so the two cannot drift), and no doc points outside the repository."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def config_keys() -> set[str]:
    """Every leaf key of the ``token-capture`` namespace, dotted (``store.units``)."""
    tree = yaml.safe_load((ROOT / "dask-config.yaml").read_text())["token-capture"]
    out: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out.add(f"{prefix}{k}")

    walk(tree, "")
    return out


def readme_table_keys() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Configuration"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    return set(re.findall(r"^\| `([a-z0-9.-]+)` \|", section, re.M))


def test_readme_configuration_table_matches_dask_config_yaml():
    in_yaml, in_readme = config_keys(), readme_table_keys()
    assert not in_yaml - in_readme, f"keys missing from the README table: {sorted(in_yaml - in_readme)}"
    assert not in_readme - in_yaml, f"README rows for keys that do not exist: {sorted(in_readme - in_yaml)}"


def test_docs_never_point_outside_the_repository():
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = path.read_text()
        assert "../shared" not in text and "SPEC.md" not in text, path.name


def test_no_issue_numbers_in_code_tests_or_docs():
    # The tree reads by topic; an issue tracker's numbers mean nothing to a newcomer.
    import re

    pattern = re.compile(r"\b[Ii]ssue\s*#?\d+")
    paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("pipeline", "tasks", "tests", "examples"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in paths for m in pattern.finditer(p.read_text())]
    assert not found, found


def test_python_api_in_20_lines_runs(tmp_path):
    # The README's API block, as written, in a fresh interpreter.
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API in 20 lines"):]
    code = section[section.index("```python\n") + 10: section.index("\n```", section.index("```python"))]
    assert len([l for l in code.splitlines() if l.strip() and not l.startswith(("import", "from"))]) <= 20
    script = tmp_path / "api.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accepted, shape = proc.stdout.split(" ", 2)[:2]
    assert accepted == "4", proc.stdout
