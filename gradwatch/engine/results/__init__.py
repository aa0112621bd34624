"""The results vocabulary of a check: the kinds of probe, verdicts and reasons (:mod:`.kinds`), notes as data
(:mod:`.notes`), the report (:mod:`.report`) with the applied findings nested in it (:mod:`.findings`), its one
rendering (:mod:`.rendering`) and what an inconclusive check lacked (:mod:`.diagnosis`)."""
