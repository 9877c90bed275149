"""tc.compile_lm with isolate=True (IREE in a subprocess) and check_numerics=True: no
false alarm from the causal mask or the KV cache, and a NaN weight is reported at the op
that first uses it, with its source line."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn

BAD_TOKEN = 7


@pytest.fixture(scope="module")
def checked():
    nn.manual_seed(0)
    cfg = models.BitNetConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                              max_position_embeddings=32)
    lm = models.BitNetLM(cfg)
    weight = np.array(lm.embed_tokens.weight)
    weight[BAD_TOKEN] = np.nan                        # only this token's embedding row
    lm.embed_tokens.load_state_dict({"weight": weight})
    return lm, tc.compile_lm(lm, max_seq=16, isolate=True, check_numerics=True, cache=False)


def test_no_false_alarm_from_mask_and_cache(checked):
    lm, gen = checked
    ids = np.array([1, 2, 3, 4, 5], np.int32)
    logits = gen.prefill(ids)
    want = lm(ids[None])[0]                           # eager reference
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, want, rtol=2e-2, atol=2e-2)
    assert np.isfinite(gen.decode(9)).all()


def test_a_nan_weight_is_reported_where_it_is_used(checked):
    _, gen = checked
    with pytest.raises(tc.NumericsError, match="produced a NaN from a constant operand that holds NaN"):
        gen.prefill(np.array([1, BAD_TOKEN, 3], np.int32))
