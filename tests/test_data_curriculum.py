"The curriculum through DataLoader workers: phase switches land on the right micro-batch and survive a resume."

import torch

import cipher_nb.data.codecs as C
from cipher_nb.config.load import Config
from cipher_nb.data.curriculum import Curriculum, build_loader


def cfg(workers, grad_accum):
    c = Config()
    c.data.sources = {"en": dict(source="mock", path="latin"), "code": dict(source="mock", path="code")}
    c.data.phases = [dict(until=0.5, mix=dict(en=1)), dict(until=1.0, mix=dict(code=1))]
    c.data.num_workers, c.data.heldout_frac, c.data.max_bytes = workers, 0.0, 48
    c.schedule.max_steps, c.training.grad_accum, c.training.batch_size, c.training.seq_len = 26, grad_accum, 2, 128
    return c


def test_phase_switch_lands_on_its_micro_batch_with_workers():
    c = cfg(workers=2, grad_accum=1)  # the switch at micro-batch 13: inside a worker's second block of 8
    switch = Curriculum(c.data, c.schedule).phases[1].start
    it = iter(build_loader(c.data, c.training, c.schedule, c.model.vocab, "train", 0, 1))
    for k in range(switch + 6):
        text = C.ByteCodec().decode_bytes(next(it)["input_ids"])
        if k < switch:
            assert b"def " not in text, k  # no code document starts before the switch
        if k > switch:
            assert b"def " in text and b"the " not in text.split(b"def ", 1)[1], k  # and only code after it


def test_resume_across_the_phase_switch_with_workers(tmp_path):
    c = cfg(workers=2, grad_accum=3)  # the switch at step 13 = micro-batch 39
    full = build_loader(c.data, c.training, c.schedule, c.model.vocab, "train", 0, 1)
    it = iter(full)
    ref = [next(it) for _ in range(50)]
    a = build_loader(c.data, c.training, c.schedule, c.model.vocab, "train", 0, 1)
    it = iter(a)
    for _ in range(35):
        next(it)
    torch.save(a.state_dict(), tmp_path / "data.pt")
    b = build_loader(c.data, c.training, c.schedule, c.model.vocab, "train", 0, 1)
    b.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=True))
    it = iter(b)
    for r in ref[35:]:
        x = next(it)
        for k in r:
            assert torch.equal(x[k], r[k]), k
    assert b.stats()["docs"] == full.stats()["docs"] and b.stats()["docs"]["code"] > 0
