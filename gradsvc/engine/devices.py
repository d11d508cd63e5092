"""The device a job runs on and what it shares with the process: resolving options.device, synchronising
before a clock reads, the float32 math a job runs in (full IEEE float32 unless TF32 is asked for), the same
dropout masks for every evaluation (a forked RNG), and an allocation failure told from other errors
(out_of_memory, with advice)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .graph.batch_flow import draws_masks
from .errors import ComputeError


def resolve_device(option: str) -> torch.device:
    if option == "cpu" or (option == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ComputeError("device_unavailable", "options.device='cuda' but this worker has no CUDA device; "
                           "use device='auto' or 'cpu', or route the job to a GPU worker")
    return torch.device("cuda", torch.cuda.current_device())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MATH_MODES = ("ieee", "tf32")


def math_mode_for(device: torch.device, asked: str) -> str:
    """The float32 math a job runs in: "tf32" only where asked and the device has it (CUDA, compute capability
    8.0 or later), else "ieee" (a CPU never runs TF32)."""
    if asked == "tf32" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return "tf32"
    return "ieee"


@contextlib.contextmanager
def float32_math(mode: str, device: torch.device):
    """Runs the block in `mode`'s float32 math on `device`, the process's own restored after. "ieee": every
    float32 convolution and matmul in full float32 (cuDNN's convolutions default to TF32 on CUDA, which moved a
    CNN's gradient 4e-4 off the float64 reference: docs/numcheck.md), and no reduced-precision reductions in
    float16 or bfloat16 matmuls; "tf32": cuBLAS and cuDNN may read float32 operands as TF32 (a 10-bit
    mantissa), reductions still as "ieee". On a CPU only the matmul precision applies (oneDNN reads it). The
    flags are the process's: a worker runs one job at a time."""
    precision = torch.get_float32_matmul_precision()
    wanted = "high" if mode == "tf32" else "highest"
    if precision != wanted:
        torch.set_float32_matmul_precision(wanted)  # cuBLAS's allow_tf32 follows it ("highest": off)
    saved = _cuda_math(mode == "tf32") if device.type == "cuda" else None
    try:
        yield mode
    finally:
        if precision != wanted:
            torch.set_float32_matmul_precision(precision)
        if saved is not None:
            _set_cuda_math(*saved)


def _cuda_math(tf32: bool) -> tuple[bool, bool, bool]:
    """Sets cuDNN's TF32 flag and the reduced-precision reductions (off) for a job; returns them as they were."""
    matmul = torch.backends.cuda.matmul
    saved = (torch.backends.cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    _set_cuda_math(tf32, False, False)
    return saved


def _set_cuda_math(cudnn_tf32: bool, fp16_reduced: bool, bf16_reduced: bool) -> None:
    with backend_flags():
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = fp16_reduced
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16_reduced


def backend_flags():
    """The block may set torch.backends' flags even where torch.backends.disable_global_flags() froze them (a process
    that imported torch.testing's common_utils, as the op_db tests do): the job owns its float32 math, and sets and
    restores the flags as torch's own flags() context managers do, through the same switch."""
    return getattr(torch.backends, "__allow_nonbracketed_mutation")()


def is_random(model: nn.Module) -> bool:
    if hasattr(model, "node_modules"):  # a GraphModel: dropout is a node, not a module
        return any(draws_masks(step) for step in model._graph.steps)
    return any(isinstance(m, nn.modules.dropout._DropoutNd) or (isinstance(m, nn.RNNBase) and m.dropout > 0)
               for m in model.modules())


@contextlib.contextmanager
def seeded(seed: int, device: torch.device, random: bool):
    """Same random numbers (dropout masks) for every evaluation, without touching the global RNG.
    Forking the RNG costs ~1 ms, so models without random layers (`random` False) skip it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=random,
                               device_type="cuda"):
        if random:
            torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def one_cpu_thread(device: torch.device, small: bool):
    """Runs the block on one intra-op thread when the work is `small` and on a CPU, the process's thread count
    restored after: the kernels, hence the answer, are the same (the callers say why it is quicker)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or not small:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def is_allocation_failure(exc: BaseException) -> bool:
    """CUDA's and cuBLAS's out of memory, the CPU allocator's, and oneDNN's: a CPU kernel whose scratch memory
    cannot be allocated says only that it "could not create a primitive"."""
    message = str(exc).lower()
    return any(said in message for said in ("out of memory", "can't allocate memory", "could not create a primitive"))


def out_of_memory(device: torch.device, exc: BaseException) -> ComputeError:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    said = (str(exc).splitlines() or [type(exc).__name__])[0][:200]  # a bare MemoryError says nothing
    return ComputeError("out_of_memory", f"{device} ran out of memory ({said}); set "
                        "options.micro_batch to split the batch or options.checkpoint_segments to trade memory "
                        "for recomputation, or use a smaller model", device=str(device))
