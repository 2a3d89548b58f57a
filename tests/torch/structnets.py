"""Nodes whose values across a cut are structures, for test_split_structured: sent by
value to the worker (network mode), since the worker cannot import the tests."""

import torch

from somatize import Node, Opaque


class Encoder(Node):
    """Reads the first of a (source, target) pair, or the whole input."""

    def __init__(self, a, b, pick=None):
        self.lin = torch.nn.Linear(a, b)
        self.pick = pick

    def forward(self, x, ctx):
        return Opaque(self.lin(x if self.pick is None else x[self.pick]).tanh())

    def parameters(self):
        return list(self.lin.parameters())


class Masked(Node):
    """Hands on its activation with the integer mask of where it is positive, shaped
    as a tuple, a list (with a plain tag beside them) or a dict (with a plain count)."""

    def __init__(self, a, b, shape):
        self.lin = torch.nn.Linear(a, b)
        self.shape = shape

    def forward(self, x, ctx):
        h = self.lin(x)
        mask = (h > 0).long()
        if self.shape == "tuple":
            return Opaque((h, mask))
        if self.shape == "list":
            return Opaque([h, mask, "tagged"])
        return Opaque({"hidden": h, "mask": mask, "rows": int(h.shape[0])})

    def parameters(self):
        return list(self.lin.parameters())


class MaskedHead(Node):
    def __init__(self, a, b):
        self.lin = torch.nn.Linear(a, b)

    def forward(self, value, ctx):
        if isinstance(value, dict):
            assert value["rows"] == value["hidden"].shape[0]
            h, mask = value["hidden"], value["mask"]
        else:
            h, mask = value[0], value[1]
        assert not mask.is_floating_point()
        return Opaque(self.lin(h * mask))

    def parameters(self):
        return list(self.lin.parameters())


class Decoder(Node):
    """Takes two inputs, the encoder's memory and the embedded target, as the walk hands
    a node with two producers: a map by producer."""

    def __init__(self, width):
        self.mix = torch.nn.Linear(2 * width, width)

    def forward(self, given, ctx):
        return Opaque(self.mix(torch.cat([given["encoder"], given["embed"]], dim=-1)).relu())

    def parameters(self):
        return list(self.mix.parameters())


class Embed(Node):
    """GPT-2's token and position embeddings: hands on the hidden states and the
    integer attention mask (1 for a token, 0 for padding), as a transformer does."""

    def __init__(self, model):
        self.wte, self.wpe = model.transformer.wte, model.transformer.wpe

    def forward(self, batch, ctx):
        ids, mask = batch
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        return Opaque((self.wte(ids) + self.wpe(positions), mask))

    def parameters(self):
        return [*self.wte.parameters(), *self.wpe.parameters()]


class Blocks(Node):
    """GPT-2's transformer blocks, causal and with padding masked out."""

    def __init__(self, model):
        self.blocks = model.transformer.h

    def forward(self, pair, ctx):
        h, mask = pair
        n = h.shape[1]
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :].bool()
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(h.dtype).min)
        for block in self.blocks:
            out = block(h, attention_mask=additive)
            h = out[0] if isinstance(out, tuple) else out  # transformers 4 answers a tuple
        return Opaque((h, mask))

    def parameters(self):
        return list(self.blocks.parameters())


class LMHead(Node):
    def __init__(self, model):
        self.norm, self.out = model.transformer.ln_f, model.lm_head

    def forward(self, pair, ctx):
        h, _ = pair
        return Opaque(self.out(self.norm(h)))

    def parameters(self):
        return [*self.norm.parameters(), *self.out.parameters()]
