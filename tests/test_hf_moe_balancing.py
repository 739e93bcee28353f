"""A transformers MoE whose config asks for its load-balancing loss (`output_router_logits`)
trains with it: flatshard's loss of one forward is transformers' (the cross-entropy plus
`router_aux_loss_coef` x the `aux_loss` its forward returns), family by family; sharded, it
equals one process on the global batch (test_cli_hf.py runs that)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hf_transformers_tp import ARCHS

from flatshard.models.registry import next_token_loss

transformers = pytest.importorskip("transformers")

COEF = 0.1  # large enough that the term stands out of the cross-entropy's rounding
# the families whose transformers forward adds the loss (DeepSeek-V3 and GLM-4-MoE have none)
BALANCED = ["qwen3_moe", "mixtral", "olmoe", "phimoe", "gpt_oss"]


@pytest.mark.parametrize("arch", BALANCED)
def test_the_loss_is_transformers_with_its_balancing_loss(arch):
    config = ARCHS[arch]()
    config.output_router_logits, config.router_aux_loss_coef = True, COEF
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    batch = torch.randint(0, config.vocab_size, (2, 9))
    ours = next_token_loss(model, batch)
    output = model(batch[:, :-1])
    cross_entropy = F.cross_entropy(output.logits.flatten(0, 1), batch[:, 1:].flatten())
    expected = cross_entropy + COEF * output.aux_loss
    assert abs(ours.item() - expected.item()) <= 1e-6 * expected.item()
    assert COEF * output.aux_loss.item() > 1e-2  # the term is there to be compared
