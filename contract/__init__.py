"""The contract: what crosses from one role to another, defined once.

Every other folder imports from here; this package imports nothing of ours. It holds the wire names (workflow types
and ids, signal, query and update names, search attributes, memo keys), the node probe's wire format, the workflow
inputs that activities, the probe and the CLI build, capacity-group configuration with its drain cap, and the
connection settings every process shares. Workflows keep their private state and query views in `workflows/`.
"""
