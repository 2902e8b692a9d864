"""The node probe: reads GPU fault signals on a host, classifies them, signals the instance's health workflow.

sources/ (kmsg, journald, a log file, NVML, DCGM, daemons) produce FaultRecords -> classify/ (kernel-log parser,
Xid catalog, policy verdicts, burst collapse, findings) -> delivery/ (spool, read cursors, reporter), driven by
probe.py. cli.py: `autorepair classify` and `autorepair probe`. It imports nothing of ours but the contract.
"""
