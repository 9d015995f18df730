"""examples/quickstart.ipynb runs, top to bottom, in a Jupyter kernel of this interpreter on
the CPU, with the built-in model standing in for the Hub model (JAXSERVE_NOTEBOOK_MODEL):
every cell runs without an error and prints what its markdown promises."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

import jaxserve

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after its run (its outputs in its cells)."""
    from ipykernel.kernelspec import install

    tmp = tmp_path_factory.mktemp("notebook")
    # A python3 kernel of this interpreter, found first; Jupyter's and IPython's own files in
    # the temporary folder (nothing read from or written to HOME but the executable cache).
    install(kernel_name="python3", prefix=str(tmp))
    env = {
        "JUPYTER_PATH": str(tmp / "share" / "jupyter"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "JUPYTER_DATA_DIR": str(tmp / "data"),
        "JUPYTER_CONFIG_DIR": str(tmp / "config"), "IPYTHONDIR": str(tmp / "ipython"),
        "JAXSERVE_NOTEBOOK_MODEL": str(jaxserve.default_model_path()),
        "JAX_PLATFORMS": "cpu",
        # `!jaxserve plan`: this interpreter's console script, whether or not it is activated
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    }
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=180,
                            resources={"metadata": {"path": str(tmp)}})
    with pytest.MonkeyPatch.context() as patch:  # (the kernel inherits this environment)
        for name, value in env.items():
            patch.setenv(name, value)
        start = time.perf_counter()
        client.execute()
    print(f"quickstart.ipynb ran in {time.perf_counter() - start:.1f} s")
    return notebook


def stdout_of(notebook, marker: str) -> str:
    """What the one code cell whose source holds marker printed."""
    cells = [c for c in notebook.cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, marker
    return "".join(o.get("text", "") for o in cells[0].outputs
                   if o.output_type == "stream" and o.name == "stdout")


def test_every_cell_ran_without_an_error(executed):
    notebook = executed
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.execution_count is not None, cell.source
            assert not [o for o in cell.outputs if o.output_type == "error"], cell.source


def test_install_is_skipped_and_the_cpu_is_listed(executed):
    notebook = executed
    assert "already installed" in stdout_of(notebook, "REPO_URL:")
    assert re.search(r"JAX \S+ on cpu\n", stdout_of(notebook, "for device in jax.devices()"))


def test_the_built_in_model_generates_then_frees_its_memory(executed):
    notebook = executed
    assert stdout_of(notebook, "llm = LLM()").strip()
    before, after = map(float, re.findall(r"([\d.]+) MiB", stdout_of(notebook, "def device_mib")))
    assert before > 1 and after < 0.1


def test_plan_prints_the_devices_share(executed):
    notebook = executed
    text = stdout_of(notebook, "!jaxserve plan")
    assert "colab-v5e-1" in text and "KV cache per device" in text, text


def test_generate_chat_and_a_json_schema_output(executed):
    notebook = executed
    lines = stdout_of(notebook, "llm.generate(prompts, params)").splitlines()
    assert len(lines) == 3 and all(" -> " in line for line in lines), lines
    assert stdout_of(notebook, "llm.chat(messages").strip()
    answer = json.loads(stdout_of(notebook, "json.loads(text)"))
    assert set(answer) == {"name", "year", "statically_typed"}
    assert isinstance(answer["name"], str) and len(answer["name"]) <= 24
    assert 1950 <= answer["year"] <= 2030
    assert isinstance(answer["statically_typed"], bool)


def test_tokens_per_second_is_measured_and_the_model_freed(executed):
    notebook = executed
    match = re.search(r"(\d+) tokens in ([\d.]+) s: ([\d.]+) tokens/s \(8 sequences on ",
                      stdout_of(notebook, "tokens/s"))
    assert match, stdout_of(notebook, "tokens/s")
    assert int(match[1]) == 8 * 48 and float(match[3]) > 0  # (a CPU runtime's run)
    assert re.fullmatch(r"after close\(\): 0\.0 MiB\n",
                        stdout_of(notebook, "llm.close()  # the Hub model"))
