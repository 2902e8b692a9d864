"""The node probe: reads GPU fault signals on a host, classifies them, signals the instance's health workflow.

kernel_log (parser) -> policy (verdicts, catalog) -> dedupe (bursts) -> findings -> spool -> reporter,
driven by probe; sources: file_follow (tail -F), kmsg. cli: `autorepair classify` and `autorepair probe`.
"""
