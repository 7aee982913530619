"""The training API's proof room: what a save leaves, and what checks it (docs/development.md, "The training API's
rooms").

The records in the run database (:mod:`~app.api.proof.store`), saved states sealed to the app
(:mod:`~app.api.proof.vault`), the attested export bundle of a save (:mod:`~app.api.proof.bundle`), a key's
checkpoints as the SDK manages them (:mod:`~app.api.proof.checkpoints`) and external weights with their signed URLs
(:mod:`~app.api.proof.external`), and ``verify --replay`` (:mod:`~app.api.proof.replay`, what it accepts in
:mod:`~app.api.proof.replay_limits`), which re-runs a bundle's ops with the engine. It imports the engine room,
never the HTTP edge or the service.
"""
