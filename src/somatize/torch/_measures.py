"""The measurements under the Audit: what one watched place saw in a step, and the
reductions that turn it into numbers — computed where the tensors are, and read back
to the CPU once per step through one sink.

Activations are pooled per place as (count, mean, spread, zeros, non-finite, at a
bound — ``_bounded`` says where an output has bounds) so pieces of a micro batch and a
module called twice make one population; a gradient's spread is read off E[g²] − E[g]²;
weights larger than ``sampled`` entries are read off a fixed random sample of runs of
neighbours, so ``update_ratio`` does not cost a copy of every weight.

A place's hooks read their Audit's public face only (``armed``, ``weights_before``,
``measured_steps``, ``kept_outputs``): plain attributes, so the hot path makes no call.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._errors import DeclarationError
from .._node import Opaque
from ._bounded import marks_of, saturation
from ._tensors import measurable_in

__all__ = ["BINS", "Held", "Place", "Sink"]

BINS = 32


_RUN = 64  # neighbouring entries per run of a sampled parameter


_HALF = (torch.float16, torch.bfloat16)


class Place:
    """A node or a module, and what it saw during the step being measured."""

    def __init__(self, audit: Any, name: str, node: str, module: Any, params: list[Any]):
        self.audit, self.name, self.node, self.module = audit, name, node, module
        self.params = params
        self.groups: dict[str, list[int]] | None = None
        self.tracks = False
        self.group_index: dict[Any, list[torch.Tensor]] = {}
        self.last_fire: torch.Tensor | None = None  # measured step each channel last fired
        self.first: int = 0  # the measured step channels were first seen
        self.clear()

    def clear(self) -> None:
        # count, bounded, scalars, and whether none was non-finite (then not among them)
        self.acts: list[tuple[int, int, list[torch.Tensor], bool]] = []
        self.grads: list[tuple[int, list[torch.Tensor], bool]] = []
        self.alive: torch.Tensor | None = None
        self.kept_acts: list[torch.Tensor] = []
        self.kept_grads: list[torch.Tensor] = []
        # tensors a bounded module answered this step, by id (held, so no id is reused)
        self.marked: dict[int, tuple] = {}
        self.held_marked: list[torch.Tensor] = []

    def hook(self, module: Any, args: Any, output: Any) -> None:
        """What a module watched ``inside=`` answered: its own bounds, if it has any,
        are noted before it is measured."""
        if self.audit.armed:
            self.mark(module, args, output)
        self.produced(output)

    def mark(self, module: Any, args: Any, output: Any) -> None:
        """A bounded module inside this place answered: note which of its tensors are
        bounded, so that the place's output is known as bounded if it is one of them."""
        audit = self.audit
        if not audit.armed:
            return
        if audit.weights_before is None:  # the step has begun: restarting clears what is noted
            audit.take_weights_before()
        for tensor, how in marks_of(module, args, output):
            self.marked[id(tensor)] = how
            self.held_marked.append(tensor)

    def produced(self, output: Any) -> None:
        audit = self.audit
        if not audit.armed:
            return
        if audit.weights_before is None:
            audit.take_weights_before()
        value = output.value if type(output) is Opaque else output
        if type(value) is torch.Tensor:  # the usual answer, without the walk
            tensors = (value,) if value.is_floating_point() and value.numel() else ()
        else:
            tensors = measurable_in(output)
        first = True
        for tensor in tensors:
            self.act(tensor, first)
            first = False
            if tensor.requires_grad:
                tensor.register_hook(self.gradient)
                if audit.kept_outputs is not None:
                    audit.kept_outputs.append(tensor)

    def act(self, tensor: torch.Tensor, first: bool) -> None:
        x = tensor.detach()
        if x.dtype in _HALF:
            x = x.float()
        flat = x.reshape(-1)
        mean = flat.mean()
        sign = flat.sign()
        # The distance is one fused pass, nothing written (squared later); the signs'
        # sum of squares counts those not zero (NaN if a NaN is). A dot or a dist costs
        # what a sum does on a CPU, where torch's var_mean costs a hundred times more.
        parts = [mean, torch.dist(flat, mean), torch.dot(sign, sign)]
        finite = _nonfinite_into(parts, flat, mean)
        saturated = saturation(tensor, flat, self.marked)
        if saturated is not None:
            parts.append(saturated[0])  # how many are at a bound
        self.acts.append((x.numel(), 0 if saturated is None else saturated[1], parts, finite))
        if first and self.tracks and x.dim() >= 2:
            # A channel fired if any of its values is not zero: the largest magnitude
            # over every dimension but the channels' is not zero (a NaN, which max
            # keeps, is not zero either). One reduction, a fifth of a comparison's
            # mask and an any over it.
            alive = x.abs().amax(dim=[0, *range(2, x.dim())]) != 0
            self.alive = alive if self.alive is None or self.alive.shape != alive.shape \
                else self.alive | alive
        if self.audit.measured_steps % self.audit.snapshot == 0:
            self.kept_acts.append(x.flatten())

    def gradient(self, grad: torch.Tensor) -> None:
        if not self.audit.armed:
            return
        g = grad.detach() if grad.requires_grad else grad  # (it does under create_graph)
        if g.dtype in _HALF:
            g = g.float()
        flat = g.reshape(-1)
        # The spread is read off E[g²] - E[g]²: a gradient's mean is rarely many times
        # its spread, so the cancellation that rules this out for activations does not
        # bite, and it saves two passes.
        total = flat.sum()
        parts = [total, torch.dot(flat, flat)]
        self.grads.append((g.numel(), parts, _nonfinite_into(parts, flat, total)))
        if self.audit.measured_steps % self.audit.snapshot == 0:
            self.kept_grads.append(g.flatten())

    def gather(self, sink: Sink, k: int, hist: bool) -> Any:
        """Puts this step's device numbers in the sink; answers how to read them back."""
        acts = [(n, b, sink.add(parts), finite) for n, b, parts, finite in self.acts]
        grads = [(n, sink.add(parts), finite) for n, parts, finite in self.grads]
        dead = self._dead(sink, k) if self.tracks and self.alive is not None else None
        act_hist = sink.add_vector(_histogram(self.kept_acts)) if hist and self.kept_acts else None
        grad_hist = sink.add_vector(_histogram(self.kept_grads)) if hist and self.kept_grads \
            else None

        def read(sink: Sink) -> dict[str, Any]:
            out = _pooled_acts([(n, b, _zero_at(sink.get(h), 3, finite))
                                for n, b, h, finite in acts])
            out.update(_pooled_grads([(n, _zero_at(sink.get(h), 2, finite)) for n, h, finite in grads],
                                     self.audit.probes))
            if acts or grads:
                out["nonfinite"] = out.pop("_act_nonfinite", 0) + out.pop("_grad_nonfinite", 0)
            if dead is not None:  # how many stayed zero, and out of how many
                out["dead_channels"], out["channels"] = dead(sink)
            if act_hist is not None:
                out["act_hist"] = _hist_read(sink.get(act_hist))
            if grad_hist is not None:
                out["grad_hist"] = _hist_read(sink.get(grad_hist))
            return out
        return read

    def _dead(self, sink: Sink, k: int) -> Any:
        alive = self.alive
        if self.last_fire is None or self.last_fire.shape != alive.shape:
            self._check_groups(alive.shape[0])
            self.first = k
            self.last_fire = torch.full(alive.shape, k - 1, dtype=torch.long, device=alive.device)
        self.last_fire = torch.where(alive, k, self.last_fire)
        if k - self.first + 1 < self.audit.window:
            return None  # not a whole window seen yet: nobody can say "the whole window"
        dead = (k - self.last_fire) >= self.audit.window
        if self.groups is None:
            handle = sink.add([dead.sum()])
            return lambda s: (int(s.get(handle)[0]), int(dead.shape[0]))
        index = self.group_index[dead.device]
        handle = sink.add([dead[i].sum() for i in index])
        names = list(self.groups)
        sizes = {name: len(channels) for name, channels in self.groups.items()}
        return lambda s: ({name: int(v) for name, v in zip(names, s.get(handle))}, sizes)

    def _check_groups(self, width: int) -> None:
        if self.groups is None:
            return
        for group, channels in self.groups.items():
            beyond = [c for c in channels if c >= width]
            if beyond:
                raise DeclarationError(
                    f"groups= for {self.name!r}: group {group!r} names channel {beyond[0]}, and "
                    f"what {self.name!r} produces has {width} channels (dimension 1); name "
                    f"channels 0 to {width - 1}")
        device = self.alive.device
        self.group_index[device] = [torch.tensor(c, dtype=torch.long, device=device)
                                    for c in self.groups.values()]


class Sink:
    """Device numbers gathered per device and read back with one ``tolist`` each: the
    scalars a step says (stacked once, rather than once per where) and a few vectors."""

    def __init__(self) -> None:
        self.scalars: dict[Any, list[torch.Tensor]] = {}
        self.vectors: dict[Any, list[torch.Tensor]] = {}
        self.sizes: dict[Any, int] = {}
        self.values: dict[Any, list[float]] = {}

    def add(self, tensors: list[torch.Tensor]) -> tuple[Any, int, int]:
        """Takes 0-dimensional tensors of one device; answers where they will be."""
        device = tensors[0].device
        mine = self.scalars.setdefault(device, [])
        mine.extend(tensors)
        return device, len(mine) - len(tensors), len(tensors)

    def add_vector(self, tensor: torch.Tensor) -> tuple[Any, int, int]:
        """Takes a 1-dimensional tensor; answers where its numbers will be (after every
        scalar of its device, hence the negative start until they are counted)."""
        device = tensor.device
        at = self.sizes.get(device, 0)
        self.vectors.setdefault(device, []).append(tensor)
        self.sizes[device] = at + tensor.shape[0]
        return device, -1 - at, tensor.shape[0]

    def read(self) -> None:
        for device in {*self.scalars, *self.vectors}:
            parts = [torch.stack(self.scalars[device])] if device in self.scalars else []
            if device not in self.vectors:  # scalars alone: to the widest dtype already
                self.values[device] = parts[0].tolist()
                continue
            joined = torch.cat(parts + self.vectors[device])  # to the widest dtype
            if device.type != "mps":  # which has no float64
                joined = joined.double()
            self.values[device] = joined.tolist()

    def get(self, handle: tuple[Any, int, int]) -> list[float]:
        device, at, size = handle
        if at < 0:
            at = len(self.scalars.get(device, ())) - 1 - at
        return self.values[device][at:at + size]


def _nonfinite(flat: torch.Tensor) -> torch.Tensor:
    """How many values are NaN or infinite: those are the ones a zero times them is
    not zero. Read as a float sum, which is far cheaper than a boolean one."""
    return flat.mul(0).nan_to_num_(1.0).sum()


def _nonfinite_into(parts: list[torch.Tensor], flat: torch.Tensor, total: torch.Tensor) -> bool:
    """Appends how many of ``flat`` are not finite to ``parts``, or answers True, having
    appended nothing, where ``total`` (their sum or mean) says that is none.

    A sum is finite only if every value is, so on a CPU, where reading it costs no
    sync and each pass over the values is paid for by the step, a finite total says
    zero without counting (an overflowing sum of finite values is counted, and found
    to be zero). On a GPU the count is two launches, and reading the total would be a
    sync, so it is always counted there."""
    if flat.is_cpu and math.isfinite(total.item()):
        return True
    parts.append(_nonfinite(flat))
    return False


def _zero_at(values: list[float], at: int, zero: bool) -> list[float]:
    """``values`` as read, with the count of non-finite values put back ``at`` its place
    where it was known to be zero and so never measured."""
    return values[:at] + [0.0] + values[at:] if zero else values


def _pooled_acts(pieces: list[tuple[int, int, list[float]]]) -> dict[str, Any]:
    """Pieces ``(count, bounded count, [mean, distance from it, not zero, nonfinite,
    (saturated)])`` as one population (means and variances combined pairwise)."""
    if not pieces:
        return {}
    if len(pieces) == 1:  # the usual case, said without the combining
        n, bounded, v = pieces[0]
        out = {"act_mean": v[0], "act_std": v[1] / math.sqrt(n), "act_zero": (n - v[2]) / n,
               "_act_nonfinite": round(v[3])}
        if bounded:
            out["act_saturated"] = v[4] / bounded
        return out
    n = sum(p[0] for p in pieces)
    mean, std = _pooled([(count, count * v[0], v[1] ** 2) for count, _, v in pieces], n)
    out = {"act_mean": mean, "act_std": std,
           "act_zero": (n - sum(v[2] for _, _, v in pieces)) / n,
           "_act_nonfinite": round(sum(v[3] for _, _, v in pieces))}
    bounded = sum(b for _, b, _ in pieces)
    if bounded:
        out["act_saturated"] = sum(v[4] for _, b, v in pieces if b) / bounded
    return out


def _pooled_grads(pieces: list[tuple[int, list[float]]], probes: int) -> dict[str, Any]:
    """Pieces ``(count, [sum, sum of squares, nonfinite])`` as one population."""
    if not pieces:
        return {}
    if len(pieces) == 1:
        n, (total, squares, nonfinite) = pieces[0]
    else:
        n = sum(p[0] for p in pieces)
        total, squares, nonfinite = (sum(v[i] for _, v in pieces) for i in range(3))
    mean = total / n
    spread = squares / n - mean * mean
    return {"grad_norm": math.sqrt(squares / probes), "grad_mean": mean,
            "grad_std": math.nan if math.isnan(spread) else math.sqrt(max(spread, 0.0)),
            "_grad_nonfinite": round(nonfinite)}


def _pooled(pieces: list[tuple[int, float, float]], n: int) -> tuple[float, float]:
    """The mean and standard deviation of pieces given as (count, sum, squared
    deviations from their own mean)."""
    mean = sum(total for _, total, _ in pieces) / n
    spread = sum(squares + count * (total / count - mean) ** 2 for count, total, squares in pieces)
    return mean, math.sqrt(spread / n) if spread >= 0 else math.nan


class Held:
    """The weights of what is watched, once each: what ``weight_norm`` and
    ``update_ratio`` are read off.

    A tensor of more than ``sampled`` entries is read as a fixed random sample of that
    many, in runs of 64 neighbours (a gather of scattered entries costs a cache line
    each), and counts as many times as the entries it stands for: copying every weight
    and passing over it twice, each measured step, would cost a tenth of a step on a
    CPU, and a sample this size puts both numbers within a few percent of the whole.

    What is read of the tensors of one device and dtype lies in one buffer (``_Rows``),
    in rows as long as the sample: a sampled tensor's runs fill one row, a smaller
    tensor fills one padded with zeros, and with ``sampled=None`` a large tensor spans
    as many rows as it needs. The buffer holds three sets of those rows: the weights
    now, as the step found them, and their difference. So a step costs one read per
    tensor (a gather or a copy into its row), one subtraction and one reduction per
    buffer, however many tensors there are, where a norm per tensor and per quantity
    cost a call each. That is three rows of 4,096 entries per watched tensor, held
    between steps; with ``sampled=None``, three copies of every watched weight.
    """

    def __init__(self, wheres: list[Place], sampled: int | None):
        params = list({id(p): p for where in wheres for p in where.params}.values())
        at = {id(p): k for k, p in enumerate(params)}
        self.params = params
        self.sampled = sampled
        self.index = [self._index(p) for p in params]
        # a row holds a sampled tensor's runs, or up to as many entries of one read whole
        self.width = max(_RUN, sampled // _RUN * _RUN) if sampled else 4096
        self.scale = [p.numel() / (p.numel() if i is None else i.numel() * _RUN)
                      for p, i in zip(params, self.index)]
        self.trained = [p.requires_grad for p in params]
        self.mine = [list(dict.fromkeys(at[id(p)] for p in where.params)) for where in wheres]
        self.buffers: list[_Rows] = []
        self.placed: list[tuple[int, int] | None] = []  # each tensor's buffer and column
        self.storage: list[int] = []  # each tensor's storage when the buffers were made
        self._lay_out()

    def _index(self, p: torch.Tensor) -> torch.Tensor | None:
        """Which runs of ``_RUN`` entries stand for ``p`` (None: all of it)."""
        if self.sampled is None or p.numel() <= self.sampled:
            return None
        generator = torch.Generator().manual_seed(p.numel())
        runs = torch.randperm(p.numel() // _RUN, generator=generator)
        return runs[:max(1, self.sampled // _RUN)].sort().values

    def _lay_out(self) -> None:
        """A buffer per device and dtype, for the tensors as they are now. Made again
        when a tensor's storage is swapped (``module.to(...)``, a ``load_state_dict``
        that assigns), since what is read is a view of it."""
        self.storage = [p.data_ptr() for p in self.params]
        kinds: dict[Any, list[int]] = {}
        for k, p in enumerate(self.params):
            if p.numel():  # an empty tensor adds nothing to any norm
                kinds.setdefault((p.device, p.dtype), []).append(k)
        self.buffers, self.placed = [], [None] * len(self.params)
        for which, ((device, dtype), ks) in enumerate(kinds.items()):
            for column, k in enumerate(ks):
                self.placed[k] = (which, column)
            self.buffers.append(_Rows(self.params, self.index, ks, self.width, device, dtype))

    def _current(self) -> bool:
        """Whether the buffers still fit the tensors; they are made again if not."""
        if [p.data_ptr() for p in self.params] == self.storage:
            return True
        self._lay_out()
        return False

    def taken(self) -> list[_Rows]:
        """Reads the weights as they are now into each buffer's "before" rows, for after
        the update, and answers those buffers: if they are made again before
        ``measured`` (a tensor moved meanwhile), that step says no ratio."""
        self._current()
        for buffer in self.buffers:
            buffer.fill(_BEFORE)
        return self.buffers

    def measured(self, sink: Sink, before: list[_Rows] | None) -> Any:
        """Puts, per tensor, its squared norm now, before and of its change in the
        sink; answers, per where (by position), its numbers."""
        if not self.params:
            return lambda at: {}
        updated = self._current() and before is self.buffers
        handles = []
        for buffer in self.buffers:
            buffer.fill(_NOW)
            if updated:
                torch.sub(buffer.now, buffer.before, out=buffer.step)
            handles.append((sink.add_vector(buffer.squares()), len(buffer.ks),
                            buffer.ends is not None))
        got: list[list[float]] = []  # each buffer's numbers, read once

        def read(at: int) -> dict[str, Any]:
            mine = self.mine[at]
            if not mine:
                return {}
            if not got:
                got.extend(sink.get(handle) for handle, _, _ in handles)
            now = old = step = 0.0
            changing = False
            for k in mine:
                placed = self.placed[k]
                if placed is None:
                    continue
                which, column = placed
                values, (_, columns, running) = got[which], handles[which]
                scale = self.scale[k]
                now += scale * _segment(values, _NOW * columns, column, running)
                if updated and self.trained[k]:
                    changing = True
                    old += scale * _segment(values, _BEFORE * columns, column, running)
                    step += scale * _segment(values, _STEP * columns, column, running)
            out = {"weight_norm": math.sqrt(now)}
            if changing:
                out["update_ratio"] = math.sqrt(step / old) if old > 0 else \
                    (0.0 if step == 0 else math.inf)
                out["update_norm"] = math.sqrt(step)
            return out
        return read


_NOW, _BEFORE, _STEP = 0, 1, 2  # the three sets of rows of a buffer


def _segment(values: list[float], start: int, column: int, running: bool) -> float:
    """A tensor's sum of squares, out of what ``_Rows.squares`` read."""
    at = start + column
    return values[at] - (values[at - 1] if running and column else 0.0)


class _Rows:
    """One buffer of ``Held``: what is read of the tensors of one device and dtype, in
    rows of ``width`` entries, three times over (now, before, the change). With the
    default sample every tensor fills one row (its 64 runs, or all of it padded with
    zeros), so a row's norm is its tensor's; a tensor of more spans several rows."""

    def __init__(self, params: list[torch.Tensor], index: list[torch.Tensor | None],
                 ks: list[int], width: int, device: Any, dtype: Any):
        self.ks = ks
        gathers: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        wholes: list[tuple[torch.Tensor, int]] = []
        ends, row = [], 0
        for k in ks:
            flat = params[k].detach().reshape(-1)
            runs = index[k]
            if runs is None:
                wholes.append((flat, row * width))
                row += -(-flat.shape[0] // width)
            else:
                runs = index[k] = runs.to(device)
                whole_runs = flat[:flat.shape[0] - flat.shape[0] % _RUN].view(-1, _RUN)
                gathers.append((whole_runs, runs, row * width, runs.shape[0] * _RUN))
                row += -(-runs.shape[0] * _RUN // width)
            ends.append(row - 1)
        self.rows = torch.zeros(3, row, width, device=device, dtype=dtype)
        self.now, self.before, self.step = self.rows.unbind(0)
        # what each fill does, made once: a gather of a sampled tensor's runs into its
        # place, one copy of the tensors read whole into theirs
        self.fills = {}
        for which in (_NOW, _BEFORE):
            flat = self.rows[which].view(-1)
            self.fills[which] = (
                [(whole_runs, runs, flat[at:at + size].view(-1, _RUN))
                 for whole_runs, runs, at, size in gathers],
                [flat[at:at + source.shape[0]] for source, at in wholes],
                [source for source, _ in wholes])
        self.ends = None if len(ends) == row else torch.tensor(ends, device=device)
        # norms of the rows in at least single precision (a complex tensor's are real
        # already); their running sums in double, which an MPS device does not have
        self.wide = None if not dtype.is_floating_point else \
            torch.float64 if dtype == torch.float64 else torch.float32
        self.sums = torch.float32 if device.type == "mps" else torch.float64

    def fill(self, which: int) -> None:
        """Reads every tensor into the rows of ``which``."""
        gathers, into, sources = self.fills[which]
        for whole_runs, runs, out in gathers:
            torch.index_select(whole_runs, 0, runs, out=out)
        if sources:
            torch._foreach_copy_(into, sources)

    def squares(self) -> torch.Tensor:
        """Each tensor's sum of squares now, before and of the change: one norm per row
        for every tensor at once, and where a tensor spans rows, running sums over them
        (a tensor's own is then the difference from the one before it)."""
        per_row = torch.linalg.vector_norm(self.rows, dim=-1, dtype=self.wide).square_()
        if self.ends is None:
            return per_row.reshape(-1)
        return per_row.cumsum(-1, dtype=self.sums).index_select(-1, self.ends).reshape(-1)


def _histogram(pieces: list[torch.Tensor]) -> torch.Tensor:
    """32 counts and 33 edges over the finite values, computed where they are."""
    x = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if x.device.type == "cpu":  # where reading a number back costs no sync
        low, high = torch.aminmax(x)  # NaN if any is: then some are not finite
        if math.isfinite(low.item()) and math.isfinite(high.item()):
            return _histogram_finite(x, low, high)
    finite = torch.isfinite(x)
    low = torch.where(finite, x, torch.inf).min()
    high = torch.where(finite, x, -torch.inf).max()
    none = ~torch.isfinite(low)
    low, high = torch.where(none, 0.0, low), torch.where(none, 0.0, high)
    width = torch.where(high > low, high - low, torch.ones_like(high))
    at = ((x - low) / width * BINS).nan_to_num(0.0, 0.0, 0.0).floor().clamp(0, BINS - 1).long()
    counts = torch.bincount(at, weights=finite.to(x.dtype), minlength=BINS)
    edges = low + width * torch.arange(BINS + 1, device=x.device, dtype=x.dtype) / BINS
    return torch.cat([counts.to(x.dtype), edges])


def _histogram_finite(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``_histogram`` of values all finite, from their least and greatest: the same
    arithmetic without the masks, and with a value's bin truncated rather than floored,
    which is the same for the values from ``low`` up."""
    width = torch.where(high > low, high - low, torch.ones_like(high))
    at = x.sub(low).div_(width).mul_(BINS).clamp_(0, BINS - 1).long()
    counts = torch.bincount(at, minlength=BINS)
    edges = low + width * torch.arange(BINS + 1, device=x.device, dtype=x.dtype) / BINS
    return torch.cat([counts.to(x.dtype), edges])


def _hist_read(values: list[float]) -> dict[str, list]:
    return {"counts": [round(c) for c in values[:BINS]], "edges": values[BINS:]}
