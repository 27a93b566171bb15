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


def test_the_readmes_default_run_figures_are_its_committed_run():
  """The README's example progress line is a line of the committed default run's log, and its
  accuracies at the start of RL and after 1000 updates are that run's scalars."""
  import json

  readme = (REPO / "README.md").read_text()
  run = REPO / "docs" / "cpu_runs" / "default_run" / "default"
  example = readme.split("```\nstep ", 1)[1].split("\n", 1)[0]
  assert f"] step {example}\n" in (run / "run.log").read_text()
  accuracy = json.loads((run / "scalars.json").read_text())["eval/accuracy"]
  assert accuracy[0][0] == 0 and accuracy[-1][0] == 1000
  assert f"| held-out greedy accuracy when RL starts | {accuracy[0][1]:.3f} |" in readme
  assert f"| held-out greedy accuracy after 1000 RL updates | {accuracy[-1][1]:.3f} |" in readme


def test_the_readmes_parity_figures_are_the_committed_test_output():
  """The README's SmolLM2 parity row (largest logit difference, identical greedy rows) is what
  tests/test_smollm2.py printed in the committed run of it."""
  import re

  readme = (REPO / "README.md").read_text()
  printed = (REPO / "docs" / "cpu_runs" / "smollm2_parity.txt").read_text()
  diff, rows = re.search(
    r"logits within ([\d.e-]+); (\d+ of \d+) greedy rows identical", readme
  ).groups()
  mantissa, exponent = diff.split("e-")
  assert (
    "max |logit difference| over " in printed and f": {mantissa}e-{int(exponent):02d}\n" in printed
  )
  assert f"{rows} rows identical\n" in printed
