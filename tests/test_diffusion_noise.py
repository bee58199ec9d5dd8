"""Per-row noise depends on (seed, stream, step) only, never on the batch."""
import pytest
import torch

from contract.errors import InvalidRequestError
from diffusion import NoiseStream, flow_match_sigmas, initial_noise, row_noise, row_seed, sde_step

SHAPE = (3, 4, 4)
BATCH = [11, 7, 123456789, 0, 42, 2**63 + 5, 9, 1]


def test_row_alone_equals_row_in_batch_of_8():
    batch = row_noise(BATCH, 3, SHAPE)
    assert batch.shape == (8, *SHAPE)
    for i, seed in enumerate(BATCH):
        assert torch.equal(row_noise([seed], 3, SHAPE)[0], batch[i])
    init = initial_noise(BATCH, SHAPE)
    assert torch.equal(initial_noise([42], SHAPE)[0], init[4])


def test_step_of_a_row_is_batch_independent():
    sigmas = flow_match_sigmas(10, shift=3.0)
    step = 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, *SHAPE, generator=g)
    v = torch.randn(8, *SHAPE, generator=g)
    s, sn = sigmas[step].expand(8), sigmas[step + 1].expand(8)
    batch = sde_step(x, v, s, sn, 0.7, row_noise(BATCH, step, SHAPE))
    i = 4
    alone = sde_step(x[i:i + 1], v[i:i + 1], s[:1], sn[:1], 0.7, row_noise([BATCH[i]], step, SHAPE))
    torch.testing.assert_close(alone.prev_sample[0], batch.prev_sample[i], atol=1e-6, rtol=0)
    torch.testing.assert_close(alone.log_prob[0], batch.log_prob[i], atol=1e-6, rtol=0)
    # a different seed for the same row gives a different step
    other = sde_step(x[i:i + 1], v[i:i + 1], s[:1], sn[:1], 0.7, row_noise([43], step, SHAPE))
    assert not torch.allclose(other.prev_sample[0], batch.prev_sample[i], atol=1e-3)


def test_seed_step_and_stream_all_change_the_noise():
    a = row_noise([5], 0, SHAPE)
    assert not torch.allclose(a, row_noise([6], 0, SHAPE))
    assert not torch.allclose(a, row_noise([5], 1, SHAPE))
    assert not torch.allclose(a, initial_noise([5], SHAPE))
    assert row_seed(5, NoiseStream.STEP, 0) != row_seed(5, NoiseStream.INITIAL, 0)
    assert torch.equal(a, row_noise([5], 0, SHAPE))                      # reproducible


def test_noise_is_standard_normal():
    n = row_noise(list(range(64)), 0, (1024,))
    assert abs(float(n.mean())) < 0.02
    assert abs(float(n.std()) - 1.0) < 0.02
    # rows are uncorrelated (no shared stream between neighbouring seeds)
    corr = torch.corrcoef(n)
    off = corr[~torch.eye(64, dtype=torch.bool)]
    assert float(off.abs().max()) < 0.15


def test_dtype_and_device():
    n = row_noise([1, 2], 0, (4,), dtype=torch.bfloat16, device="cpu")
    assert n.dtype == torch.bfloat16
    torch.testing.assert_close(n.float(), row_noise([1, 2], 0, (4,)).bfloat16().float())


@pytest.mark.parametrize("seeds,step,field", [([], 0, "seeds"), ([1, -1], 0, "seeds[1]"),
                                              ([1, 2.0], 0, "seeds[1]"), ([True], 0, "seeds[0]"),
                                              ([2**64], 0, "seeds[0]"), ([1], -1, "step_index")])
def test_bad_seeds(seeds, step, field):
    with pytest.raises(InvalidRequestError) as e:
        row_noise(seeds, step, SHAPE)
    assert e.value.field == field
