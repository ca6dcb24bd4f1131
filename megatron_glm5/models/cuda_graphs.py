"""A module's forward and backward captured as CUDA graphs and replayed in its place (the plan's ``moe_cuda_graph``).

Why: a GLM MoE layer (megatron-core's ``MoELayer``: router, top-k, token permutation, grouped expert GEMMs,
unpermutation, shared expert) launches about a hundred small kernels forward, and the Python that launches them
costs more host time than the GPU needs for them at a few thousand tokens per step, so the forward waits for the
host (on an H200 at 4K tokens the step's forward takes ~55 ms of host time for ~45 ms of kernels when run eagerly,
the MoE layers about a third of that host time). A replayed graph launches the whole layer at once. The transformer layer
graphs its whole MLP half (``Glm5TransformerLayer._mlp_half``: the mHC input side, norm, MoE layer and mHC output
side, residual streams in and out): the mHC's Python costs about as much host time as the MoE layer's did.

What is captured, per input signature (shape, dtype and device of ``x`` and of the extra tensors):

    forward   out = fn(x', *extras)                          x requires grad (the layer: streams [s, b, n, h]), out
    backward  (d_x, d_params) = autograd.grad(out, (x', *params'), d_out)

on static buffers in one private memory pool, where ``x'`` and ``params'`` are views of the static input and of
the parameters (:func:`aliased_parameters`: the capture never waits on the parameters' ``AccumulateGrad`` nodes,
which keep the stream they were made on). :class:`GraphedModule` replays them through an autograd function,
so the parameters' gradients reach ``.grad`` (and megatron DDP's grad hooks) as in eager mode; the forward's output
is copied out of the pool (callers may keep it). What makes a replay wrong is caught before it happens:

* **State captured by address.** Graphs read the parameters and buffers at the addresses they had at capture. A
  replay first checks that the module still holds the same tensors at those addresses (``module.to(...)`` or a
  reassigned ``.data`` moves them, an assigned ``nn.Parameter`` replaces one) and captures again if not. Buffers
  the forward updates in place (the router's ``local_tokens_per_expert`` for the aux-loss-free expert bias) are
  updated by every replay as by every eager call; the warm-up and capture calls themselves restore them, so they
  count each real step exactly once.
* **megatron-core's aux-loss state.** An aux loss, sequence aux loss or z-loss of the router is captured with the
  layer: its forward adds the loss into the metrics tracker's per-layer tensor in place
  (``get_moe_metrics_tracker().metrics[name].values``) and its backward reads ``MoEAuxLossAutoScaler``'s loss scale,
  which megatron's schedule sets in place every micro-batch. A replay checks that both are still the tensors the
  capture saw (:func:`aux_loss_state`) and captures again if not; the warm-up and capture calls restore the
  tracker's values, as they do the buffers.
* **Two forwards in flight.** A second forward through the same graphs before the first one's backward would
  overwrite the activations that backward needs (a pipeline schedule with several micro-batches in flight): such
  a forward runs eagerly. A forward whose autograd graph is dropped without a backward does not block later ones.
* **Gradients kept across steps.** ``AccumulateGrad`` may keep a returned parameter-gradient buffer itself as
  ``param.grad`` (no copy); before either graph replays again (the two share one pool), a ``.grad`` still aliasing
  one is copied out, so gradient accumulation over micro-batches sums correctly. The input's gradient and the
  output are returned as copies.
* **A capture that fails** (something in ``fn`` cannot be captured) leaves the module eager from then on, with one
  warning.
* **cuBLAS workspaces.** Each capture runs inside :func:`cublas_workspaces_of_capture`, so the workspace its
  GEMMs bake in is its own, not the one cached for PyTorch's shared capture stream by an earlier capture.

On CUDA the execution plan turns it on (``megatron_glm5.execution_plan``); docs/performance.md has the measured
step times with and without it. Each capture's GEMMs get their own cuBLAS workspace (above): with a workspace shared
between captures, a later capture overwrote a 32 MiB stretch of an earlier graph's expert weight gradients (NaN),
exactly cuBLAS's Hopper workspace size.

Calls outside training (``module.training`` off, autograd off, autocast on, an input without gradient, a CPU
tensor, or while another graph is being captured) run eagerly. Eligibility that depends on the model is the
execution plan's (:func:`megatron_glm5.execution_plan.moe_graph_blockers`): collectives, host-side routing
loops, activation recompute.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_glm5.execution_plan import moe_graph_blockers

__all__ = ["GraphedModule", "aliased_parameters", "aux_loss_state", "cublas_workspaces_of_capture",
           "describe_graphed_modules", "graphed_modules", "moe_graph_blockers"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def aliased_parameters(module: torch.nn.Module, params: Sequence[torch.nn.Parameter]):
    """Within the block every parameter in ``params`` is replaced, in every submodule of ``module`` holding it, by
    a view of itself (same storage, so a captured graph reads the parameter's memory); yields the views, in order.

    Gradients are then taken with respect to the views, not the leaf parameters: autograd never runs (or waits on
    the stream of) the parameters' ``AccumulateGrad`` nodes while a graph is captured. Those nodes keep the stream
    they were created on and may be kept alive from outside (megatron's DDP holds them for its gradient hooks); a
    capture that waits on the default stream is invalidated.
    """
    aliases = {id(p): _alias(p) for p in params}
    swapped = []
    try:
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and id(p) in aliases:
                    mod._parameters[name] = aliases[id(p)]
                    swapped.append((mod, name, p))
        yield [aliases[id(p)] for p in params]
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


_MAIN_GRAD_ATTRIBUTES = ("main_grad", "zero_out_wgrad")


def _alias(p: torch.nn.Parameter) -> torch.Tensor:
    """A view of ``p`` carrying megatron DDP's attributes of it (``main_grad``, ``zero_out_wgrad``), so that a fused
    weight gradient taken inside a captured graph adds into the parameter's own ``main_grad``; its
    ``grad_added_to_main_grad`` starts False and tells afterwards whether the backward did (read by
    :class:`_CapturedGraphs`, which sets the parameter's flag at every replay)."""
    alias = p.view_as(p)
    for name in _MAIN_GRAD_ATTRIBUTES:
        if hasattr(p, name):
            setattr(alias, name, getattr(p, name))
    if hasattr(p, "grad_added_to_main_grad"):
        alias.grad_added_to_main_grad = False
    return alias


@contextlib.contextmanager
def fusion_off(parts: Sequence[torch.nn.Module]):
    """Within the block every submodule of ``parts`` with a ``gradient_accumulation_fusion`` flag has it off
    (restored after): their weight gradients then reach the parameters through autograd, not ``main_grad``."""
    flagged = [m for part in parts for m in part.modules()
               if isinstance(getattr(m, "gradient_accumulation_fusion", None), bool)]
    flags = [m.gradient_accumulation_fusion for m in flagged]
    try:
        for m in flagged:
            m.gradient_accumulation_fusion = False
        yield
    finally:
        for m, f in zip(flagged, flags):
            m.gradient_accumulation_fusion = f


def check_aliases_carry_gradients(module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                                  alias_grads: Sequence[Optional[torch.Tensor]],
                                  leaf_grads: Sequence[Optional[torch.Tensor]]):
    """Raise ``RuntimeError`` unless each parameter's whole gradient flowed through its alias (of
    :func:`aliased_parameters`): a module that reaches a parameter some other way than its parameter slot (a
    reference kept elsewhere) would lose that part of the gradient in the captured backward."""
    names = {id(p): n for n, p in module.named_parameters()}
    for p, a, g in zip(params, alias_grads, leaf_grads):
        if (a is None) != (g is None) or (a is not None and not torch.equal(a, g)):
            raise RuntimeError(f"parameter {names.get(id(p), '?')} is used outside its module slot; "
                               "its gradient would bypass the captured graph")


def aux_loss_state() -> Dict[tuple, torch.Tensor]:
    """The tensors outside the layer that a captured router's aux loss / z-loss reads or writes by address:
    ``("metric", name)``: the metrics tracker's per-layer values (the forward adds each loss in place), and
    ``("scale",)``: ``MoEAuxLossAutoScaler``'s loss scale (the backward multiplies by it) once it exists."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    state = {("metric", name): entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}
    if MoEAuxLossAutoScaler.main_loss_backward_scale is not None:
        state[("scale",)] = MoEAuxLossAutoScaler.main_loss_backward_scale
    return state


@contextlib.contextmanager
def cublas_workspaces_of_capture(device: torch.device):
    """Around one graph capture: the cuBLAS (and cuBLASLt) workspace the graph bakes in is allocated during that
    capture, inside its pool, and no later capture, eager call or graph destruction sees it.

    PyTorch keeps one workspace per (cuBLAS handle, stream) and ``torch.cuda.graph`` captures every graph on one
    process-wide side stream. Without this, the first capture allocates that stream's workspace inside its own
    pool and every later capture, of any layer, bakes the same address in; PyTorch 2.11 also frees a capture
    stream's workspace when any graph captured on it is destroyed, while other live graphs still use it
    (pytorch/pytorch#193402). On the H200 this gave NaN weight gradients to two experts of the first graphed MoE
    layer (a 32 MiB stretch, the workspace's size) at 2K tokens. Clearing the cached workspaces before the
    capture makes its first GEMM allocate a fresh one in the graph's pool; clearing them after drops the entry,
    so the workspace's memory returns to this pool only. A later capture into the same pool (the backward graph,
    which shares the forward graph's pool) may reuse it for its own buffers: the forward replay's GEMMs then
    scratch over backward-graph memory that holds nothing live between the backward replay and the next forward
    replay (gradient buffers still held as ``.grad`` are copied out first, :meth:`_CapturedGraphs.release_grads`).
    What inductor's CUDA-graph trees do around their captures; one synchronize per capture."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:  # a PyTorch without it: nothing to scope
        yield
        return
    torch.cuda.synchronize(device)
    clear()
    try:
        yield
    finally:
        clear()


# Parameters, buffers and submodules registered on any module so far (``module.weight = nn.Parameter(...)``,
# ``register_buffer``, ``module.child = ...``): a captured graph lists its module's tensors once and walks the
# module tree again only after this moved, instead of on every replay.
_REGISTRATIONS = [0]


def _count_registration(*_args):
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)
torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


class _Token:
    """Marks a replayed forward whose backward has not run yet (held by the autograd node; weakly by the graphs)."""


class _CapturedGraphs:
    """The forward and backward graphs of one input signature, with their static buffers; ``parts``
    (:meth:`GraphedModule.parts`) are the modules whose parameters and buffers ``fn`` reads."""

    def __init__(self, module: torch.nn.Module, fn: Callable, x: torch.Tensor, extras: Sequence[torch.Tensor],
                 warmup: int, parts: Sequence[torch.nn.Module]):
        self.params = list({id(p): p for part in parts for p in part.parameters() if p.requires_grad}.values())
        buffers = list({id(b): b for part in parts for b in part.buffers()}.values())
        saved = [b.clone() for b in buffers]
        metrics = {k: (t, t.clone()) for k, t in aux_loss_state().items() if k[0] == "metric"}
        self.static_x = x.detach().clone().requires_grad_(True)
        self.static_extras = [e.detach().clone() for e in extras]

        stream = torch.cuda.Stream(device=x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, autotunes, lazy inits, cuBLAS handles
            for i in range(max(warmup, 2)):
                # the first call checks the parameters' gradients (fusion off: all through autograd); the others
                # run the fused weight gradients too, with a zero output gradient, which adds exact zeros to the
                # parameters' main_grad (every weight gradient is linear in it)
                with fusion_off(parts) if i == 0 else contextlib.nullcontext():
                    out, x_alias, aliases = self._aliased_forward(module, fn)
                    leaves = tuple(self.params) if i == 0 else ()
                    grad_out = torch.ones_like(out) if i == 0 else torch.zeros_like(out)
                    grads = torch.autograd.grad(out, (x_alias, *aliases, *leaves), grad_out, allow_unused=True)
                if leaves:
                    check_aliases_carry_gradients(module, self.params, grads[1:1 + len(aliases)],
                                                  grads[1 + len(aliases):])
                del out, grads
        torch.cuda.current_stream(x.device).wait_stream(stream)

        try:
            self.fwd = torch.cuda.CUDAGraph()
            with cublas_workspaces_of_capture(x.device), torch.cuda.graph(self.fwd):
                self.static_out, x_alias, aliases = self._aliased_forward(module, fn)
            self.static_grad_out = torch.zeros_like(self.static_out)
            self.bwd = torch.cuda.CUDAGraph()
            with cublas_workspaces_of_capture(x.device), torch.cuda.graph(self.bwd, pool=self.fwd.pool()):
                grads = torch.autograd.grad(self.static_out, (x_alias, *aliases), self.static_grad_out,
                                            allow_unused=True)
            self.static_grad_x = grads[0]
            self.static_grad_params = list(grads[1:])
            # the parameters whose captured backward adds their gradient into main_grad itself
            self.fused = [bool(getattr(a, "grad_added_to_main_grad", False)) for a in aliases]
        finally:
            with torch.no_grad():  # the warm-up and capture calls ran the module: undo their in-place updates
                for b, s in zip(buffers, saved):
                    b.copy_(s)
                for k, t in aux_loss_state().items():
                    if k[0] != "metric":
                        continue
                    if k in metrics and metrics[k][0] is t:
                        t.copy_(metrics[k][1])
                    else:  # a tracker entry the warm-up made: it starts at zero, as the eager call's would
                        t.zero_()
        self._record_tensors(parts, [p for p, fused in zip(self.params, self.fused) if fused])
        self.in_flight: Optional[weakref.ref] = None

    def _aliased_forward(self, module: torch.nn.Module, fn: Callable):
        """``fn`` on a view of the static input with the parameters swapped for views (:func:`aliased_parameters`)
        -> ``(out, input view, parameter views)``: what the warm-up runs and the forward graph records."""
        with aliased_parameters(module, self.params) as aliases:
            x_alias = self.static_x.view_as(self.static_x)
            return fn(x_alias, *self.static_extras), x_alias, aliases

    @staticmethod
    def _slots(parts: Sequence[torch.nn.Module]) -> list:
        """``(owning dict, name, tensor)`` of every parameter and buffer of the modules ``parts`` and their
        submodules."""
        return [(d, name, t) for part in parts for m in part.modules() for d in (m._parameters, m._buffers)
                for name, t in d.items() if t is not None]

    def _record_tensors(self, parts: Sequence[torch.nn.Module], fused: Sequence[torch.nn.Parameter] = ()):
        """The parts' parameters and buffers, their addresses and the registration count they were read at,
        megatron-core's aux-loss tensors (:func:`aux_loss_state`, after the warm-up made any the layer uses), and
        the ``fused`` parameters, whose ``main_grad`` the captured backward adds into by address."""
        self.fused_params = tuple(fused)
        self.slots = self._slots(parts)
        self.addresses = tuple(t.data_ptr() for _, _, t in self.slots) + self._main_grad_addresses()
        self.registrations = _REGISTRATIONS[0]
        self.external = aux_loss_state()

    def valid_for(self, parts: Sequence[torch.nn.Module]) -> bool:
        """Whether the graphs still read the parts' parameters and buffers: the same tensors in the same slots
        (``Module._apply`` may put new ones straight into ``_parameters``; after a registration anywhere -- a new
        parameter, buffer or submodule -- the module tree is walked again) at the same addresses (``param.data =
        ...``, as megatron's DDP and ``Module.to`` do, moves them), and megatron-core's aux-loss tensors
        (:func:`aux_loss_state`) are the ones captured. Cheap enough for every replay: no walk of the module tree
        unless something was registered."""
        if self.registrations != _REGISTRATIONS[0]:
            slots = self._slots(parts)
            if len(slots) != len(self.slots) or any(a[2] is not b[2] for a, b in zip(slots, self.slots)):
                return False
            self.slots, self.registrations = slots, _REGISTRATIONS[0]
        external = aux_loss_state() if self.external else {}
        return (all(d.get(name) is t for d, name, t in self.slots)
                and tuple(t.data_ptr() for _, _, t in self.slots) + self._main_grad_addresses() == self.addresses
                and all(external.get(k) is t for k, t in self.external.items()))

    def _main_grad_addresses(self) -> tuple:
        """Where the fused parameters' ``main_grad`` s are (the captured backward adds into them by address)."""
        return tuple(p.main_grad.data_ptr() for p in self.fused_params)

    def busy(self) -> bool:
        return self.in_flight is not None and self.in_flight() is not None

    def release_grads(self):
        """Copy out any ``param.grad`` that is still one of the backward graph's gradient buffers (kept by
        ``AccumulateGrad`` without a copy): the next replay of either graph reuses that memory."""
        for p, g in zip(self.params, self.static_grad_params):
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()


class _Replay(torch.autograd.Function):
    """Autograd node of one replayed forward: ``(graphs, n_extras, x, *extras, *params) -> out`` (the parameters
    are inputs so that their gradients, returned by the backward graph, reach ``AccumulateGrad``)."""

    @staticmethod
    def forward(ctx, graphs: _CapturedGraphs, n_extras: int, x: torch.Tensor, *rest):
        graphs.release_grads()
        graphs.static_x.copy_(x)
        for dst, src in zip(graphs.static_extras, rest[:n_extras]):
            dst.copy_(src)
        graphs.fwd.replay()
        ctx.graphs, ctx.n_extras = graphs, n_extras
        ctx.token = _Token()
        graphs.in_flight = weakref.ref(ctx.token)
        return graphs.static_out.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        graphs = ctx.graphs
        graphs.release_grads()
        graphs.static_grad_out.copy_(grad_out)
        graphs.bwd.replay()
        for p, fused in zip(graphs.params, graphs.fused):
            if fused:  # megatron's contract of a fused weight gradient: DDP's hook adds nothing
                p.grad_added_to_main_grad = True
        graphs.in_flight = None
        ctx.token = None
        grads_params = [None if g is None else g.detach() for g in graphs.static_grad_params]
        return (None, None, graphs.static_grad_x.clone(), *([None] * ctx.n_extras), *grads_params)


class GraphedModule:
    """Runs ``fn(x, *extras)`` -- a function of ``module`` -- as replayed CUDA graphs when it can (see the module
    docstring), eagerly otherwise. At most ``max_graphs`` input signatures are kept (least recently used dropped:
    each holds its activations' memory).

    ``parts``: the names of the submodules of ``module`` that ``fn`` uses, when that is not all of it (a transformer
    layer whose MLP half is graphed: its mHC, norm and MoE layer); only their parameters become inputs of the replay
    and only their tensors are checked before one (looked up by name each time, so a submodule assigned in place of
    one is noticed). ``module`` itself gives the training flag.

    Not a ``nn.Module`` on purpose: it owns no parameters (``module``'s stay where they are, in its state dict).

    megatron-core's gradient-accumulation fusion runs inside the graphs: the parameter views carry their
    parameter's ``main_grad`` (:func:`_alias`), so the captured backward adds the fused weight gradients (the
    linears', the grouped experts') into the parameters' ``main_grad`` by address, and each replay marks those
    parameters ``grad_added_to_main_grad`` for DDP's hook. A replay checks that the ``main_grad`` s have not moved.
    """

    def __init__(self, module: torch.nn.Module, fn: Callable, max_graphs: int = 2, warmup: int = 2,
                 parts: Sequence[str] = ()):
        self.module, self.fn = module, fn
        self.part_names = tuple(parts)
        self.max_graphs, self.warmup = max_graphs, warmup
        self.graphs: Dict[tuple, _CapturedGraphs] = {}
        self.eager_calls = 0
        self.replays = 0
        self.disabled: Optional[str] = None  # why capturing failed, once it has

    def parts(self) -> tuple:
        """The modules whose tensors the graphs read: ``module``'s submodules named by ``parts``, else ``module``."""
        return tuple(self.module.get_submodule(n) for n in self.part_names) or (self.module,)

    def reset(self):
        """Drop every captured graph (their memory returns to the caching allocator once nothing else holds it)."""
        self.graphs.clear()

    @staticmethod
    def _signature(x: torch.Tensor, extras: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device, t.stride()) for t in (x, *extras))

    def eligible(self, x: torch.Tensor, extras: Sequence[Optional[torch.Tensor]]) -> bool:
        return (x.is_cuda and self.module.training and torch.is_grad_enabled() and x.requires_grad
                and not torch.is_autocast_enabled("cuda") and not torch.cuda.is_current_stream_capturing()
                and all(e is not None and e.is_cuda and not e.requires_grad for e in extras))

    def __call__(self, x: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        if self.disabled or not self.eligible(x, extras):
            self.eager_calls += 1
            return self.fn(x, *extras)
        key = self._signature(x, extras)
        graphs = self.graphs.pop(key, None)
        if graphs is not None and not graphs.valid_for(self.parts()):
            graphs = None  # parameters or buffers moved: capture again
        if graphs is not None and graphs.busy():
            self.graphs[key] = graphs
            self.eager_calls += 1
            return self.fn(x, *extras)
        if graphs is None:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.pop(next(iter(self.graphs)))
            try:
                graphs = _CapturedGraphs(self.module, self.fn, x, extras, self.warmup, self.parts())
            except RuntimeError as e:  # torch.AcceleratorError too: something in fn cannot be captured
                self.disabled = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                log.warning("CUDA graph capture of %s failed, it runs eagerly from now on: %s",
                            type(self.module).__name__, self.disabled)
                torch.cuda.synchronize(x.device)
                self.eager_calls += 1
                return self.fn(x, *extras)
        self.graphs[key] = graphs  # most recently used last
        self.replays += 1
        return _Replay.apply(graphs, len(extras), x, *extras, *graphs.params)


def graphed_modules(model_chunks: Sequence[torch.nn.Module]) -> List[GraphedModule]:
    """The :class:`GraphedModule` s of a model's chunks (held by its layers as ``mlp_graphs``), in module order."""
    return [m.mlp_graphs for chunk in model_chunks for m in chunk.modules()
            if isinstance(getattr(m, "mlp_graphs", None), GraphedModule)]


def describe_graphed_modules(model_chunks: Sequence[torch.nn.Module]) -> Optional[str]:
    """One line on how the :func:`graphed_modules` of a model ran, for the end of a training run: ``"MoE CUDA
    graphs: 2 layers, 16 replays, 0 eager calls"`` (plus the reason when a capture failed); None when there are
    none."""
    graphed = graphed_modules(model_chunks)
    if not graphed:
        return None
    line = (f"MoE CUDA graphs: {len(graphed)} layers, {sum(g.replays for g in graphed)} replays, "
            f"{sum(g.eager_calls for g in graphed)} eager calls")
    failed = [g.disabled for g in graphed if g.disabled]
    return line + (f"; {len(failed)} layers run eagerly after a failed capture ({failed[0]})" if failed else "")
