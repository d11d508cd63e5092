"""The Redis/RQ side every process shares: key names, the job record and its serializer, leases,
handoff files, the graph and tensor stores. Imports the contract (`gradsvc.wire`) and nothing above."""
