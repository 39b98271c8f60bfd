"""What a reader of the built site gets: pages, words per page, rendered signatures, raw Sphinx markup left in the
text, links, headings and rendered formulas — counted on ``mkdocs build`` output. Prints a table and writes
``benchmarks/results/docs_site.json``; ``--label`` names the column (``before`` from a checkout of an older commit).

    python benchmarks/docs_site.py --label after
    git worktree add /tmp/old <commit> && python benchmarks/docs_site.py --root /tmp/old --label before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

RESULT = Path(__file__).parent / "results" / "docs_site.json"
#: text a reader should never see: Sphinx roles and directives printed as they are written
RAW_MARKUP = re.compile(r":(?:class|func|meth|attr|mod|math|data|obj|exc|ref):|\.\. math::")


class _Text(HTMLParser):
    """The visible text of the page's article, its links and its headings."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 inside <article>
        self.skip = 0  # > 0 inside <script>/<style>
        self.words: list[str] = []
        self.links = 0
        self.h2 = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.depth += tag == "article"
        self.skip += tag in ("script", "style")
        if self.depth:
            self.links += tag == "a" and any(k == "href" and v and not v.startswith("#") for k, v in attrs)
            self.h2 += tag == "h2"

    def handle_endtag(self, tag: str) -> None:
        self.depth -= tag == "article" and self.depth > 0
        self.skip -= tag in ("script", "style") and self.skip > 0

    def handle_data(self, data: str) -> None:
        if self.depth and not self.skip:
            self.words.extend(data.split())


def page_counts(html: str) -> dict[str, int]:
    text = _Text()
    text.feed(html)
    body = " ".join(text.words)
    return {
        "words": len(text.words),
        "links": text.links,
        "h2": text.h2,
        "signatures": html.count('class="doc-signature'),
        "raw markup": len(RAW_MARKUP.findall(body)),
        "formulas": html.count("<math"),
        "raw LaTeX": len(re.findall(r"\\\(|\\\[", body)),
    }


def build(root: Path, site: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(site)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"mkdocs build failed in {root}:\n{proc.stderr[-3000:]}")


def site_counts(site: Path) -> dict[str, object]:
    pages = {
        str(p.relative_to(site).parent) or ".": page_counts(p.read_text())
        for p in sorted(site.rglob("index.html"))
        if "<article" in p.read_text()
    }
    totals = {key: sum(page[key] for page in pages.values()) for key in next(iter(pages.values()))}
    return {
        "pages": len(pages),
        "max words per page": max(page["words"] for page in pages.values()),
        "guide pages without an H2": sorted(name for name, page in pages.items() if page["h2"] == 0),
        **totals,
        "per page": pages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(__file__).parents[1], help="the checkout to build")
    parser.add_argument("--label", default="after", help="the column this build fills in the JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(args.root, Path(tmp) / "site")
        counts = site_counts(Path(tmp) / "site")
    results = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    results[args.label] = counts
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(results, indent=1) + "\n")
    rows = ["pages", "max words per page", "words", "signatures", "raw markup", "raw LaTeX", "formulas", "links"]
    labels = list(results)
    print("| count | " + " | ".join(labels) + " |\n|---|" + "---:|" * len(labels))
    for row in rows:
        print(f"| {row} | " + " | ".join(str(results[label].get(row, "")) for label in labels) + " |")
    for label in labels:
        print(f"{label}: pages without an H2: {', '.join(results[label]['guide pages without an H2']) or 'none'}")


if __name__ == "__main__":
    main()
