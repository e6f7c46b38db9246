"""Accelerate entry point: the :class:`~trainvitals.adapters.loop.Vitals` driver.

Example::

    from accelerate import Accelerator
    from trainvitals import NormMonitor, ThroughputMonitor
    from trainvitals.adapters.accelerate import Vitals

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs/exp1")
    accelerator.init_trackers("exp1")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    vitals = Vitals([NormMonitor(), ThroughputMonitor()], accelerator=accelerator)
    vitals.attach(model, optimizer)
    accelerator.register_for_checkpointing(vitals)
    for batch in loader:
        vitals.batch(batch)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.end_training()  # closes vitals first (a vitals.close() before it is fine too)
"""

from trainvitals.adapters.loop import Vitals

__all__ = ["Vitals"]
