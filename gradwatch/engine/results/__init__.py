"""The results vocabulary of a check: the kinds of probe, verdicts and reasons (:mod:`.kinds`), notes as data
(:mod:`.notes`), the report (:mod:`.report`), its one rendering (:mod:`.rendering`) and what an inconclusive check
lacked (:mod:`.diagnosis`)."""
