"""The documentation: every Python snippet in README.md and docs/ runs, the MkDocs site builds in strict mode (a
broken link or reference fails), and the README stays a front page."""

import os
import re
import shutil
import subprocess
import sys
from html import unescape
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
        import torch

        # one intra-op thread, and Lightning's launcher told so (it raises the count unless OMP_NUM_THREADS is set):
        # after a parent that ran OpenMP-parallel work (the doctor's checks), the child's first parallel op hung for
        # the 600 s below
        torch.set_num_threads(1)
        os.chdir(cwd)
        os.environ.update(env, OMP_NUM_THREADS="1")
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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as ``mkdocs build --strict`` makes it from a clean clone: ``.api-src`` (made by docs/hooks.py) does
    not exist before the build starts (CI's first build failed on exactly that: mkdocstrings dropped the missing path
    and found no ``lightning_muon.metrics``)."""
    shutil.rmtree(ROOT / ".api-src", ignore_errors=True)
    out = tmp_path_factory.mktemp("site")
    proc = mkdocs_build(ROOT, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def mkdocs_build(root: Path, site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_site_builds_offline_and_publishes_no_build_code(site):
    assert [p.name for p in site.rglob("hooks.py")] == []  # the build's hook is not published
    assert [str(p) for p in site.rglob("*.html") if external_assets(p.read_text())] == []  # readable offline
    assert external_assets('<link href="https://fonts.googleapis.com/css?family=Roboto">')  # the control
    assert not (site / "sitemap.xml").exists()  # no site_url: no sitemap of relative addresses


def external_assets(html: str) -> list[str]:
    """Fonts, stylesheets and scripts a page loads from another site."""
    return re.findall(r'<(?:link|script)[^>]+(?:href|src)="(https?://[^"]+)"', html)


#: entry id -> text its rendered signature must show (the real defaults)
SIGNATURES = {
    "api/optimizer": {
        "lightning_muon.optim.PeriodicRowwiseMuon": ["lr: float | Tensor = 0.02", "period: int = 3",
                                                      "rownorm_scale: float | str = 0.15", "momentum: float = 0.95"],
        "lightning_muon.optim.MuonConfig": ["period: int = 3"],
    },
    "api/parallelism": {"lightning_muon.muon_param_groups": ["model: Module"]},
    "api/strategy": {"lightning_muon.MuonFSDPStrategy": ["hsdp: bool = False", "blocks: str | list[str] | None"]},
    "api/recipes": {
        "lightning_muon.recipes.DiTModule": ['optimizer: Optimizer = "periodic_muon"', "muon: MuonConfig = MuonConfig("]
    },
    "api/callbacks": {"lightning_muon.callbacks.GenerationEvaluation": ["every_n_steps: int = 500"]},
    "api/metrics": {
        f"lightning_muon.metrics.{name}": ["extractor: FeatureExtractor"]
        for name in ("FrechetDistance", "PrecisionRecallDensityCoverage", "MaximumMeanDiscrepancy",
                     "KernelInceptionDistance", "InceptionScore")
    } | {"lightning_muon.metrics.HPSv2Score": ["("], "lightning_muon.metrics.GenEval2": ["("]},
}  # fmt: skip


def signature(html: str, entry: str) -> str | None:
    """The plain text of the signature rendered for ``entry`` (its heading's id), or None."""
    match = re.search(rf'id="{re.escape(entry)}".*?class="doc-signature[^"]*">(.*?)</code>', html, re.S)
    return unescape(re.sub(r"<[^>]+>", "", match.group(1))) if match else None


@pytest.mark.parametrize("page", sorted(SIGNATURES))
def test_the_api_shows_signatures_with_their_defaults(site, page):
    html = (site / page / "index.html").read_text()
    for entry, shown in SIGNATURES[page].items():
        text = signature(html, entry)
        assert text is not None, f"{entry}: no signature on {page}"
        assert all(part in " ".join(text.split()) for part in shown), (entry, text)
    assert signature(html.replace("doc-signature", "doc-x"), next(iter(SIGNATURES[page]))) is None  # the control


#: what a reader must never see: Sphinx roles and directives as they are written, LaTeX not rendered
RAW = re.compile(r":(?:class|func|meth|attr|mod|math|data|obj|exc|ref):|\.\. math::|\\\(|\\\[|\$\$")


def visible_text(html: str) -> str:
    html = re.sub(r"<(script|style|math)\b.*?</\1>", " ", html, flags=re.S)
    return unescape(re.sub(r"<[^>]+>", " ", html))


def test_no_raw_markup_and_the_math_renders_without_a_script(site):
    pages = {str(p.relative_to(site)): p.read_text() for p in site.rglob("*.html")}
    raw = {name: RAW.findall(visible_text(html)) for name, html in pages.items()}
    assert {name: found for name, found in raw.items() if found} == {}
    optimizer = pages["api/optimizer/index.html"]
    assert optimizer.count('<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">') >= 1  # the rule
    assert not re.search(r"mathjax|katex", "".join(pages.values()), re.I)  # MathML: no math script at all
    assert RAW.findall(visible_text("<p>returns :class:`~a.B` and</p><div>.. math::</div><p>\\(x\\)</p>")) == [
        ":class:",
        ".. math::",
        "\\(",
    ]  # the control


def test_every_guide_page_has_sections(site):
    def without_h2(pages: dict[str, str]) -> list[str]:
        return sorted(name for name, html in pages.items() if "<h2" not in html.split("<article", 1)[-1])

    guide = {p.parent.name: p.read_text() for p in site.glob("*/index.html")}
    assert len(guide) >= 14 and without_h2(guide) == []
    assert without_h2({"x": "<article><h1>x</h1><p>text</p></article>"}) == ["x"]  # the control


def test_the_api_pages_list_exactly_what_the_packages_export():
    """One entry per name of each package's ``__all__`` (and of ``lightning_muon.checkpoint``'s), nothing else."""
    assert api_coverage(api_entries()) == ([], [])
    assert api_coverage(api_entries()[1:]) == ([api_entries()[0]], [])  # the control: a name left out


def api_entries() -> list[str]:
    return [i for page in sorted((ROOT / "docs" / "api").glob("*.md")) for i in API_ENTRY.findall(page.read_text())]


API_ENTRY = re.compile(r"^::: (\S+)", re.M)
API_PACKAGES = ("lightning_muon", "lightning_muon.optim", "lightning_muon.metrics", "lightning_muon.callbacks",
                "lightning_muon.recipes", "lightning_muon.checkpoint")  # fmt: skip


def api_coverage(entries: list[str]) -> tuple[list[str], list[str]]:
    """``(exported but not documented, documented but not exported or documented twice)``."""
    import importlib

    exported = [f"{p}.{n}" for p in API_PACKAGES for n in importlib.import_module(p).__all__]
    objects = {name: api_object(name) for name in exported}
    covered = [next((e for e in exported if objects[e] is api_object(entry)), entry) for entry in entries]
    seen = set()
    extra = [e for e in covered if e not in objects or e in seen or seen.add(e)]
    # a name exported by two packages (lightning_muon and lightning_muon.optim) is one entry
    missing = sorted({e for e in exported if e not in seen and not any(objects[e] is objects[s] for s in seen)})
    return missing, extra


def api_object(path: str) -> object:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_parameter_of_a_documented_class_has_its_own_entry():
    """``Args:`` names each parameter once (a grouped "a / b:" entry is also refused by the strict build)."""
    import dataclasses
    import inspect

    classes = [o for o in map(api_object, api_entries()) if inspect.isclass(o) and not dataclasses.is_dataclass(o)]
    # protocols are not constructed; exceptions take a message
    classes = [c for c in classes if not getattr(c, "_is_protocol", False) and not issubclass(c, BaseException)]
    assert len(classes) >= 20
    assert {c.__name__: undocumented_parameters(c) for c in classes if undocumented_parameters(c)} == {}

    class Control:
        """Args:\n    a / b: grouped."""

        def __init__(self, a: int, b: int = 1) -> None: ...

    assert undocumented_parameters(Control) == ["a", "b"]


def undocumented_parameters(cls: type) -> list[str]:
    import inspect

    doc = inspect.getdoc(cls) or ""
    section = re.search(r"^Args:\n((?:[ \t]+.*\n|[ \t]*\n)+)", doc + "\n", re.M)
    entries = re.findall(r"^ {4}(\w+)(?: \([^)]*\))?:", section.group(1), re.M) if section else []
    params = [p for p in inspect.signature(cls).parameters.values() if p.kind is not p.VAR_POSITIONAL]
    return [p.name for p in params if p.name not in entries]


def test_an_entry_naming_no_parameter_fails_the_build(tmp_path):
    """The control of the strict build's parameter check (mkdocs.yml ``warn_unknown_params``)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# x\n\n::: m.f\n")
    (tmp_path / "m.py").write_text('def f(a, b):\n    """F.\n\n    Args:\n        a / b: grouped.\n    """\n')
    config = (ROOT / "mkdocs.yml").read_text()
    options = config[config.index("          options:") :]
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: x\nplugins:\n  - mkdocstrings:\n      handlers:\n        python:\n          paths: [.]\n" + options
    )
    proc = mkdocs_build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0 and "does not appear in the function signature" in proc.stderr


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
    """Short, and readable on a package index: there a relative link leads nowhere (pages are named by path)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    assert relative_links(readme) == []
    assert relative_links("see [the optimizer](docs/optimizer.md) and [arXiv](https://arxiv.org)") == [
        "docs/optimizer.md"
    ]  # the control


def relative_links(markdown: str) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", markdown) if not re.match(r"https?://", t)]
