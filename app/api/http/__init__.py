"""The training API's HTTP edge (docs/development.md, "The training API's rooms").

The Tinker REST routes over the service (:mod:`~app.api.http.server`), TLS that terminates inside the CVM and the
attestation that binds it (:mod:`~app.api.http.tls`), and ``cvm-tune api attest``, the client side that checks it
(:mod:`~app.api.http.attest`). The top of the API: nothing below imports it but :mod:`app.api` itself.
"""
