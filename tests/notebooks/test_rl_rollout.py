"""Executes notebooks/rl_rollout.ipynb (default model, REINFORCE on the final norm, weights pushed to pagellm every
step): every cell runs, the mean reward of the last steps exceeds that of the first steps by more than twice the
standard error of the difference (over the sampled completions), and the reward is plotted."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytest.importorskip("matplotlib", reason="the notebook plots the reward per step")
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "rl_rollout.ipynb"


def test_rl_rollout_notebook_reward_rises(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    line = next(ln for ln in text.splitlines() if ln.startswith("mean reward of the first"))
    first, first_se = (float(x) for x in line.split("first 3 steps: ")[1].split(",")[0].split(" +/- "))
    last, last_se = (float(x) for x in line.split("of the last 3: ")[1].split(" +/- "))
    # The rise must exceed twice the standard error of the difference, both measured over this run's samples.
    assert last - first > 2 * (first_se**2 + last_se**2) ** 0.5, line
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs)
