"""Flywheel's extension of vLLM's workers (`--worker-extension-cls flywheel_worker.FlywheelWorker`),
loaded inside the vLLM server (this folder is put on its PYTHONPATH; it imports only torch), and
called through `/collective_rpc`.

`flywheel_reload_weights(weights_path)` is vLLM's `reload_weights` from a Hugging Face
directory, made right for tied weights on the CPU build. There a linear layer runs on a packed
copy of its weight made when it was processed (`dispatch_cpu_unquantized_gemm`), and a reload
processes again only the layers whose weights the checkpoint holds: a tied output layer
(SmolLM2's, tiny's `lm_head`, which the checkpoint leaves out) kept computing logits with the
old embedding (measured: log-probs 0.7 off the new weights'). So every layer that shares its
weight with another is processed again after the reload, from the weight now loaded. A
directory without weights is refused before anything is touched: a reload that fails half-way
kills vLLM's engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

VERSION = "1"


class FlywheelWorker:
    def flywheel_extension(self) -> str:
        """That this extension is loaded (and which)."""
        return VERSION

    def flywheel_reload_weights(self, weights_path: str) -> None:
        # Checked first: a reload that fails half-way leaves vLLM's model unusable (its engine
        # then fails every request), one refused here changes nothing.
        if not list(Path(weights_path).glob("*.safetensors")):
            raise FileNotFoundError(f"no .safetensors weights in {weights_path}")
        self.reload_weights(weights_path=weights_path)
        by_storage: dict[int, list[torch.nn.Module]] = {}
        for module in self.model_runner.get_model().modules():
            weight = module._parameters.get("weight")
            if isinstance(weight, torch.Tensor) and weight.numel():
                by_storage.setdefault(weight.data_ptr(), []).append(module)
        for modules in by_storage.values():
            if len(modules) < 2:
                continue
            for module in modules:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(module, "cpu_linear"):  # the CPU build's packed copy
                    method.process_weights_after_loading(module)
