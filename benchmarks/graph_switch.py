"""One CUDA graph that runs one of several captured graphs, chosen on the GPU: a SWITCH conditional node
(a measurement helper of ``profile_conditional_rounds.py``; not used by the library, see
docs/speculative-performance.md, "Rounds chosen on the device").

The match-gated speculative rounds (``hf_accel.speculative``) pick each round's graph (a plain step or a verify
pass over k drafts) from what the previous round's lookup found. Chosen by the host, every round waits for
the previous one's counters to reach it. Here the choice stays on the device: a round graph ends by writing
the index of the next round's graph into an int32 in device memory, and :class:`GraphSwitch` is a graph of

    [set kernel: read the index, cudaGraphSetConditional] -> SWITCH(index) {branch 0 | branch 1 | ...}

repeated ``rounds`` times, so that the host can queue rounds ahead as the plain decode loop does.
(NVIDIA, CUDA Programming Guide, "Conditional Graph Nodes"; SWITCH nodes since CUDA 12.8.)

PyTorch 2.11 has no API for conditional nodes, so the graph is built with the CUDA driver API through
``ctypes``: the branches are PyTorch graphs captured with ``keep_graph=True`` (``raw_cuda_graph()``), added as
child-graph nodes of the SWITCH bodies (the driver clones them; their memory stays owned by the PyTorch
graphs, which the switch keeps alive), and the set kernel is compiled with NVRTC, which ships with PyTorch's
CUDA builds. :func:`switch_unavailable` says why it cannot be used on this machine (then the caller keeps the
host's choice).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Sequence

import torch

__all__ = ["GraphSwitch", "switch_unavailable"]

_MIN_DRIVER = 12080  # SWITCH conditional nodes
_NODE_TYPE_CONDITIONAL = 13  # CU_GRAPH_NODE_TYPE_CONDITIONAL
_COND_TYPE_SWITCH = 2  # CU_GRAPH_COND_TYPE_SWITCH
_COND_ASSIGN_DEFAULT = 1  # CU_GRAPH_COND_ASSIGN_DEFAULT: the value resets to the default at every launch

_SET_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                     unsigned int value);
extern "C" __global__ void hf_accel_set_switch(cudaGraphConditionalHandle handle, const int *index,
                                               unsigned int size) {
    int i = *index;
    cudaGraphSetConditional(handle, (i >= 0 && (unsigned int)i < size) ? (unsigned int)i : size);
}
"""


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p)]


class _ConditionalParams(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [("handle", ctypes.c_uint64), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)), ("ctx", ctypes.c_void_p)]


class _NodeParamsUnion(ctypes.Union):
    _fields_ = [("reserved1", ctypes.c_longlong * 29), ("conditional", _ConditionalParams)]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams (256 bytes)
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("u", _NodeParamsUnion),
                ("reserved2", ctypes.c_longlong)]


class _Driver:
    """The few driver and NVRTC entry points the switch needs, loaded once."""

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        self.check(self.cu.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.version = version.value
        major = int(str(torch.version.cuda).split(".")[0])
        self.nvrtc = None
        for name in (f"libnvrtc.so.{major}", "libnvrtc.so"):
            try:
                self.nvrtc = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if self.nvrtc is None:
            raise OSError(f"no NVRTC library (libnvrtc.so.{major}) could be loaded")
        self._functions: dict[int, ctypes.c_void_p] = {}

    def check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self.cu.cuGetErrorString(result, ctypes.byref(text))
            raise RuntimeError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")

    def context(self) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise RuntimeError("no current CUDA context")
        return ctx

    def set_kernel(self) -> ctypes.c_void_p:
        """The set kernel of the current context's device (NVRTC, once per device)."""
        device = torch.cuda.current_device()
        func = self._functions.get(device)
        if func is not None:
            return func
        major, minor = torch.cuda.get_device_capability(device)
        prog = ctypes.c_void_p()
        rtc = self.nvrtc

        def rtc_check(result, what):
            if result != 0:
                raise RuntimeError(f"{what} failed: NVRTC error {result}")

        rtc_check(rtc.nvrtcCreateProgram(ctypes.byref(prog), _SET_SOURCE.encode(), b"hf_accel_switch.cu", 0,
                                         None, None), "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
            res = rtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if res != 0:
                size = ctypes.c_size_t()
                rtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value)
                rtc.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC could not compile the switch kernel: {log.value.decode(errors='replace')}")
            size = ctypes.c_size_t()
            rtc_check(rtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            rtc_check(rtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        finally:
            rtc.nvrtcDestroyProgram(ctypes.byref(prog))
        module = ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        func = ctypes.c_void_p()
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(func), module, b"hf_accel_set_switch"),
                   "cuModuleGetFunction")
        self._functions[device] = func
        return func


@functools.cache
def _driver() -> _Driver:
    return _Driver()


def switch_unavailable() -> str | None:
    """Why :class:`GraphSwitch` cannot run here (no CUDA, a driver older than 12.8, a PyTorch without
    ``CUDAGraph(keep_graph=True)``, no NVRTC), or None."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "no CUDA device"
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
        return f"PyTorch {torch.__version__} has no CUDAGraph(keep_graph=True) / raw_cuda_graph()"
    try:
        drv = _driver()
    except (OSError, RuntimeError, AttributeError) as e:
        return f"the CUDA driver or NVRTC could not be loaded: {e}"
    if drv.version < _MIN_DRIVER:
        return f"CUDA driver {drv.version // 1000}.{drv.version % 1000 // 10} is older than 12.8 (SWITCH nodes)"
    return None


def keep_graph() -> torch.cuda.CUDAGraph:
    """A PyTorch graph whose ``cudaGraph_t`` outlives its capture, for a :class:`GraphSwitch` branch (it is
    instantiated for its own ``replay()`` as well)."""
    return torch.cuda.CUDAGraph(keep_graph=True)


class GraphSwitch:
    """``rounds`` times in a row: run ``branches[index]`` (nothing if the index is outside the branches), with
    ``index`` read on the device right before each branch, so a branch may set the index of the next.

    Args:
        branches: PyTorch CUDA graphs captured with ``keep_graph=True`` (:func:`keep_graph`), on the current
            device; they stay alive as long as the switch (their memory pools hold the buffers they use).
        index: int32 tensor of one element on that device (read in place at every round).
        rounds: branches per :meth:`replay`, at least 1.

    Raises:
        RuntimeError: the driver refused the graph (for instance a node type a conditional body may not hold);
            the message names the call. ValueError: bad arguments.
    """

    def __init__(self, branches: Sequence[torch.cuda.CUDAGraph], index: torch.Tensor, rounds: int = 1):
        if not branches:
            raise ValueError("GraphSwitch needs at least one branch")
        if index.dtype != torch.int32 or index.numel() != 1 or not index.is_cuda:
            raise ValueError(f"index must be one int32 element on a CUDA device, got {index.dtype} "
                             f"{tuple(index.shape)} on {index.device}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        reason = switch_unavailable()
        if reason is not None:
            raise RuntimeError(f"GraphSwitch is not available: {reason}")
        drv = _driver()
        self._drv = drv
        self.branches = list(branches)  # keeps their graphs and memory pools alive
        self.index = index
        self.rounds = rounds
        raws = []
        for i, g in enumerate(self.branches):
            raw = g.raw_cuda_graph()
            if not raw:
                raise ValueError(f"branch {i} has no kept cudaGraph_t (capture it with CUDAGraph(keep_graph=True))")
            raws.append(ctypes.c_void_p(raw))
        cu = drv.cu
        ctx = drv.context()
        func = drv.set_kernel()
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()
        drv.check(cu.cuGraphCreate(ctypes.byref(self._graph), 0), "cuGraphCreate")
        try:
            prev = None
            size = len(raws)
            for _ in range(rounds):
                handle = ctypes.c_uint64()
                drv.check(cu.cuGraphConditionalHandleCreate(ctypes.byref(handle), self._graph, ctx,
                                                            ctypes.c_uint(size), ctypes.c_uint(_COND_ASSIGN_DEFAULT)),
                          "cuGraphConditionalHandleCreate")
                args = [ctypes.c_uint64(handle.value), ctypes.c_void_p(index.data_ptr()), ctypes.c_uint(size)]
                arg_ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
                kp = _KernelNodeParams(func=func, gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=1, blockDimY=1,
                                       blockDimZ=1, sharedMemBytes=0,
                                       kernelParams=ctypes.cast(arg_ptrs, ctypes.c_void_p), extra=None, kern=None,
                                       ctx=None)
                set_node = ctypes.c_void_p()
                deps, ndeps = (ctypes.byref(prev), 1) if prev is not None else (None, 0)
                add_kernel = getattr(cu, "cuGraphAddKernelNode_v2", None) or cu.cuGraphAddKernelNode
                drv.check(add_kernel(ctypes.byref(set_node), self._graph, deps, ctypes.c_size_t(ndeps),
                                     ctypes.byref(kp)), "cuGraphAddKernelNode")
                params = _NodeParams()
                params.type = _NODE_TYPE_CONDITIONAL
                params.u.conditional.handle = handle.value
                params.u.conditional.type = _COND_TYPE_SWITCH
                params.u.conditional.size = size
                params.u.conditional.ctx = ctx
                cond = ctypes.c_void_p()
                drv.check(cu.cuGraphAddNode(ctypes.byref(cond), self._graph, ctypes.byref(set_node), ctypes.c_size_t(1),
                                            ctypes.byref(params)), "cuGraphAddNode (SWITCH)")
                bodies = params.u.conditional.phGraph_out
                for i, raw in enumerate(raws):
                    child = ctypes.c_void_p()
                    drv.check(cu.cuGraphAddChildGraphNode(ctypes.byref(child), ctypes.c_void_p(bodies[i]), None,
                                                          ctypes.c_size_t(0), raw), f"cuGraphAddChildGraphNode ({i})")
                prev = cond
            drv.check(cu.cuGraphInstantiateWithFlags(ctypes.byref(self._exec), self._graph, ctypes.c_ulonglong(0)),
                      "cuGraphInstantiateWithFlags")
        except BaseException:
            self.close()
            raise

    def replay(self) -> None:
        """Launch on the current stream (asynchronous, as ``CUDAGraph.replay``)."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._drv.check(self._drv.cu.cuGraphLaunch(self._exec, stream), "cuGraphLaunch")

    def close(self) -> None:
        """Free the driver's graph objects (the branches stay with their owners)."""
        drv = getattr(self, "_drv", None)
        if drv is None:
            return
        if getattr(self, "_exec", None) is not None and self._exec.value:
            drv.cu.cuGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if getattr(self, "_graph", None) is not None and self._graph.value:
            drv.cu.cuGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: the driver may be gone)
            pass
