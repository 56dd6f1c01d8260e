"""The model catalog the operator keeps: one checked document in the store's meta table, edited
through the admin API (`control_plane.api.models`), sent to gateways inside the region summaries.

`edits`: each edit as a pure function of the catalog; `registry`: the stored document, audited and
followed between replicas; `schemas`: the admin API's bodies; `listing`: what `GET /v1/models`
shows (the catalog beside the regions serving each model, and the models nodes serve unlisted).
"""
