"""The training API's engine room: what runs the ops (docs/development.md, "The training API's rooms").

:mod:`~app.api.engine.engine` holds the base model and one LoRA adapter per model; every operation runs on the one
worker thread (:mod:`~app.api.engine.worker`), forward_backward ops of several models share one base-model pass
(:mod:`~app.api.engine.packed`), samples decode alone or batched (:mod:`~app.api.engine.sampling`,
:mod:`~app.api.engine.sample_batch`). The losses (:mod:`~app.api.engine.losses`, server-side custom losses in
:mod:`~app.api.engine.custom_loss` within :mod:`~app.api.engine.loss_bounds`), DP-SGD (:mod:`~app.api.engine.dp`),
each model's op chain (:mod:`~app.api.engine.history`), loading a saved state (:mod:`~app.api.engine.loading`),
admission (:mod:`~app.api.engine.admission`) and the Unsloth backend (:mod:`~app.api.engine.backend`) are here too.
It imports only :mod:`app.api.errors` and :mod:`app.api.wire` of the rest of the API.
"""
