"""The documentation: every Python snippet in README.md and docs/ runs, the MkDocs site builds in strict mode (a
broken link or reference fails), and the README stays a front page."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
INCLUDE = re.compile(r'^--8<-- "([^"]+)"\s*$')


def snippets(pages: list[Path]) -> list[tuple[str, str]]:
    """``(page:line, code)`` of every fenced ``python`` block."""
    found = []
    for page in pages:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


SNIPPETS = snippets(PAGES)


def test_every_page_has_its_snippets_found():
    assert len(SNIPPETS) >= 6  # README's three examples and the guide's; the control below
    assert snippets([ROOT / "docs" / "optimizer.md"])[0][1].startswith("from lightning_muon import")


@pytest.mark.parametrize(("where", "code"), SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_runs(where, code, tmp_path):
    include = INCLUDE.match(code.strip())
    if include:  # a file shown whole: it must be one tests/test_examples.py runs
        assert (ROOT / include.group(1)).is_file()
        assert Path(include.group(1)).name in (ROOT / "tests" / "test_examples.py").read_text()
        return
    code_, error = run_forked(code, tmp_path, {"LIGHTNING_MUON_CACHE": str(tmp_path / "cache")})
    assert code_ == 0, f"{where}:\n{error[-3000:]}"


def run_forked(code: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run ``code`` as a script in a child forked from this process, in its own directory and environment: it starts
    with the modules imported here (a fresh interpreter re-imports torch and Lightning: 10-15 s a snippet on a 2-core
    machine). Returns the exit code and the traceback of a failure."""
    import multiprocessing
    import traceback

    error = cwd / "snippet-error.txt"

    def child() -> None:
        os.chdir(cwd)
        os.environ.update(env)
        try:
            exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
        except BaseException:
            error.write_text(traceback.format_exc())
            os._exit(1)
        os._exit(0)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(600)
    if process.exitcode is None:
        process.kill()
        return -1, "timed out after 600 s"
    return process.exitcode, error.read_text() if error.exists() else ""


def test_a_broken_snippet_fails(tmp_path):
    """The control: a snippet that raises is caught, with its traceback."""
    code, error = run_forked("import lightning_muon\nundefined_model", tmp_path, {})
    assert code == 1 and "NameError: name 'undefined_model' is not defined" in error


def test_the_site_builds_in_strict_mode(tmp_path):
    """From a clean clone: ``.api-src`` (made by docs/hooks.py) does not exist before the build starts. CI's first
    build failed on exactly that (mkdocstrings dropped the missing path and found no ``lightning_muon.metrics``)."""
    shutil.rmtree(ROOT / ".api-src", ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("PeriodicRowwiseMuon", "GenEval2", "Preemption", "AtomicCheckpointIO", "DiTModule"):
        assert name in api  # the reference is generated from the docstrings of what __all__ exports
    site = tmp_path / "site"
    assert [p.name for p in site.rglob("hooks.py")] == []  # the build's hook is not published
    assert [str(p) for p in site.rglob("*.html") if external_assets(p.read_text())] == []  # readable offline
    assert external_assets('<link href="https://fonts.googleapis.com/css?family=Roboto">')  # the control


def external_assets(html: str) -> list[str]:
    """Fonts, stylesheets and scripts a page loads from another site."""
    return re.findall(r'<(?:link|script)[^>]+(?:href|src)="(https?://[^"]+)"', html)


def test_a_broken_link_fails_the_build(tmp_path):
    """The control: strict mode refuses a page linking to a page that does not exist."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[missing](nowhere.md)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: x\nstrict: true\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "nowhere.md" in proc.stderr


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) < 250
