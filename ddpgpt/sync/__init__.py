"""How gradients are synchronized across ranks (run.sync): one table of modes, and one small
interface (sync/base.py, with `make_sync`) that the Trainer calls the same way whatever the mode.

    sync = make_sync(cfg.run.sync, model, groups, env, bucket_mb)  # wraps, lays it out
    optimizer = Optimizer(groups, sync.params(), ...)           # over what this rank steps
    for each micro-step m of A:
        with sync.micro_step(last=m == A - 1):
            sync.model(x, y), backward   # on the last one, the gradient sync starts in backward
    sync.finish()                        # every rank holds the mean gradient (zero1: its shards)
    norm = sync.clip(max_norm)           # the global gradient norm
    sync.before_update(); optimizer.step(); sync.after_update(); sync.zero_grad()
    sync.model_state(), sync.optimizer_state(optimizer)   # checkpoints: full tensors, the layout
                                                          # of torch's optimizers over the whole
                                                          # model, whatever the mode and W

The table (`MODES`, sync/modes.py) is the one place that says what a mode can do: where its code
lives, whether it shards the optimizer state or reduce-scatters its buckets, whether it works with
fp16's loss scaler and with gradient compression, and the bytes a rank sends per step, with the
schedule that decides how much of them the backward hides. A new mode is one file under sync/ and
one row there.

The table imports no torch: the command line checks run.sync against it before any heavy
import. At world size 1 every mode is the model itself, with no collective (unless a one-rank
group was asked for: `ddpgpt bench --group`).
"""
