"""Hand-picked fused ops as torch custom ops (namespace "opfuse"), with
autograd and fake (meta) implementations, usable eagerly and inside anyone's
torch.compile without a graph break:

    opfuse.ops.softmax(x, dim)            opfuse.ops.log_softmax(x, dim)
    opfuse.ops.layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5)
    opfuse.ops.rms_norm(x, normalized_shape, weight=None, eps=None)
    opfuse.ops.attention(q, k, v, *, causal=False, scale=None, attn_mask=None)

Each norm/softmax forward is one fused opfuse kernel (generated, compiled and
cached per dtype, rank, device and flags); their backward ops are opfuse
kernels too. attention's forward is the FlashAttention-2-style CUDA kernel
(bf16/f16) or the C++ CPU kernels; its backward is not a fused kernel yet
(PyTorch ops evaluating the FlashAttention backward equations). docs/ops.md
has the details.
"""
from .attention import attention
from .norms import layer_norm, log_softmax, rms_norm, softmax

__all__ = ["attention", "softmax", "log_softmax", "layer_norm", "rms_norm"]
