"""A stock transformers Qwen2 decoder block compiles whole: torch.compile(fullgraph=True), as fsdp.compile
compiles each block (parallelize.py), with the arguments Qwen2Model passes it, raises no graph break, and
the compiled model computes what the eager one does, loss and gradients. bench/gpu_fsdp.py's compiled loops
(its MFU figure) depend on it on the GPU machine, whose transformers (5.17) is not this one: this test shows
the block as transformers ships it here, on the CPU (Inductor's C++ backend instead of Triton)."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.support.tiny_model import tiny_lm

VOCAB = 128


def loss_and_gradients(lm: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    lm.zero_grad()
    loss = lm(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in lm.parameters() if p.grad is not None]


def test_a_stock_qwen2_decoder_block_compiles_with_fullgraph() -> None:
    lm = tiny_lm(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, attn_implementation="sdpa")
    blocks = lm.model.layers
    assert type(blocks[0]).__module__ == "transformers.models.qwen2.modeling_qwen2", "transformers' own"
    batch = torch.randint(0, VOCAB, (2, 32))
    eager_loss, eager_gradients = loss_and_gradients(lm, batch)

    torch._dynamo.reset()
    compiler = CompileCounterWithBackend("inductor")  # Inductor, counting the graphs it is handed
    for block in blocks:
        block.compile(backend=compiler, fullgraph=True)  # a graph break raises here instead of splitting
    compiled_loss, compiled_gradients = loss_and_gradients(lm, batch)

    assert compiler.frame_count >= 1 and compiler.op_count > 0, "the blocks ran compiled"
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=1e-5)
    assert len(compiled_gradients) == len(eager_gradients)
    for compiled, eager in zip(compiled_gradients, eager_gradients, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-5)
