"""What the README and docs/ pages tell a user to install holds on a machine like theirs."""

import re

from conftest import REPO


def _pages():
  return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_page_installing_the_peer_extra_says_to_take_torchs_cpu_build_first():
  """`pip install -e '.[peer]'` alone pulls torch's CUDA build (about 6 GB) onto a CPU machine:
  each page that gives the command says to install torch's CPU build first."""
  pages = [p for p in _pages() if re.search(r"\.\[peer\]", p.read_text())]
  assert pages, "no page gives the peer extra's install command"
  for page in pages:
    text = page.read_text()
    assert "torch's CPU build first" in text, page.name


def test_the_readme_fits_a_screen_and_links_every_docs_page():
  """The README's first lines are the install-and-run commands; it stays short, and each
  docs/ page is one link away."""
  readme = (REPO / "README.md").read_text()
  assert readme.splitlines()[3].startswith("# 1. install and run the main job")
  assert "pip install -e . && python -m jaxrl_llm.main --config=configs/default.py" in readme
  assert "pip install -e '.[test,tpu]' && python -m pytest" in readme
  assert len(readme.splitlines()) <= 120
  for page in sorted((REPO / "docs").glob("*.md")):
    assert f"docs/{page.name}" in readme, page.name
