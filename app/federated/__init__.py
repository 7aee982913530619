"""Attested federated rounds on Flower: a ServerApp (the aggregator, itself in a CVM) and a ClientApp (one per data
owner's CVM) exchanging LoRA adapters; every client update is an attested export bundle that the aggregator verifies
before aggregation, and every round ends in a round bundle attested by the aggregator's own quote.

Light at import: the Flower apps live in :mod:`app.federated.server_app` and :mod:`app.federated.client_app`.
"""
