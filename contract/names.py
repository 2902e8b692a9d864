"""Wire names: what a workflow, signal, query, update or memo key is called on the Temporal server.

They are in recorded histories and in operators' scripts (`temporal workflow signal --name ...`), so they change
only with a migration. Workflow code, activities, the CLI and the probe all take them from here.
"""

from typing import Final

DEFAULT_TASK_QUEUE: Final = "gpu-autorepair"

# Workflow types (each workflow class's `@workflow.defn(name=...)`).
HEALTH_WORKFLOW: Final = "InstanceHealthWorkflow"
REPAIR_WORKFLOW: Final = "InstanceRepairWorkflow"
SEMAPHORE_WORKFLOW: Final = "DrainSemaphoreWorkflow"
LIVENESS_WORKFLOW: Final = "LivenessTrackerWorkflow"
FLEET_BREAKER_WORKFLOW: Final = "FleetBreakerWorkflow"
# One per event sink target: events the sink did not take at once wait here (contract/event_outbox.py).
EVENT_OUTBOX_WORKFLOW: Final = "EventOutboxWorkflow"

# Signals to a health workflow: the probe's two, the repair's progress, and the game-day injection.
SIGNAL_GPU_FINDING: Final = "gpu_finding"
SIGNAL_HEARTBEAT: Final = "heartbeat"
SIGNAL_REPAIR_PROGRESS: Final = "repair_progress"
SIGNAL_INJECT_HEARTBEAT_LOSS: Final = "inject_heartbeat_loss"
SIGNAL_LIVENESS: Final = "liveness"  # from the group's liveness tracker: lost or heard again
# From the worker's per-group AWS reader, only when what it sees of the instance changed (contract/aws_status.py).
SIGNAL_AWS_STATUS: Final = "aws_status"

# Signals to a liveness tracker: reporters' batches, a game day's silence, and the group's changed configuration.
SIGNAL_LIVENESS_REPORT: Final = "liveness_report"
SIGNAL_IGNORE_HEARTBEATS: Final = "ignore_heartbeats"
SIGNAL_GROUP_CHANGED: Final = "group_changed"
SIGNAL_RECHECK_LOSS: Final = "recheck_loss"

# Signals between a repair and its group's drain semaphore.
SIGNAL_REQUEST: Final = "request"
SIGNAL_RELEASE: Final = "release"
SIGNAL_PERMIT_GRANTED: Final = "permit_granted"
SIGNAL_LAUNCH_OUTCOME: Final = "launch_outcome"  # a repair's launch in an AZ: capacity error or launched
SIGNAL_PERMIT_DENIED: Final = "permit_denied"  # a held repair let go by `--resume --discard-held`

# The breaker: health workflows tell their group's semaphore of each impairment, semaphores tell the fleet breaker,
# and the fleet breaker tells every semaphore when it holds or resumes.
SIGNAL_IMPAIRED: Final = "impaired"
SIGNAL_FLEET_HOLD: Final = "fleet_hold"

# To an event outbox, from publish_event (signal-with-start): one OutboxEntry; or, handed over together while an
# earlier hand-over to the same outbox was in flight, OutboxEntries.
SIGNAL_OUTBOX_ENQUEUE: Final = "enqueue"
SIGNAL_OUTBOX_ENQUEUE_MANY: Final = "enqueue_many"

# Queries and updates.
QUERY_HEALTH: Final = "health"  # health workflow: InstanceHealthView
QUERY_STATUS: Final = "status"  # repair workflow: RepairStatus
QUERY_STATE: Final = "state"  # drain semaphore: SemaphoreView
QUERY_LIVENESS: Final = "liveness"  # liveness tracker: LivenessView
QUERY_LAST_HEARD: Final = "last_heard"  # liveness tracker: list of instance ids -> {instance id: last receipt}
QUERY_GROUP_CONFIG: Final = "group_config"  # drain semaphore: GroupConfigState
UPDATE_GROUP: Final = "update_group"  # drain semaphore: GroupConfigUpdate -> GroupConfigState
UPDATE_CLAIM_REPLACEMENT: Final = "claim_replacement"  # drain semaphore: ReplacementClaim -> ReplacementClaimed
# Per-instance operator controls, on a health workflow (contract/instances.py): request -> InstanceControlResult.
UPDATE_EXCLUDE_INSTANCE: Final = "exclude_instance"  # InstanceExclude
UPDATE_INCLUDE_INSTANCE: Final = "include_instance"  # InstanceInclude
UPDATE_REPAIR_INSTANCE: Final = "repair_instance"  # InstanceRepairNow
UPDATE_CLEAR_FINDINGS: Final = "clear_findings"  # FindingsClear
# On a repair, from its health workflow (through an activity): RepairWithdrawal -> RepairWithdrawalResult.
UPDATE_WITHDRAW_REPAIR: Final = "withdraw_repair"
QUERY_OUTBOX: Final = "outbox"  # event outbox: OutboxView
QUERY_FLEET_BREAKER: Final = "fleet_breaker"  # fleet breaker: FleetBreakerView
UPDATE_FLEET_RESUME: Final = "resume"  # fleet breaker: FleetResume -> FleetBreakerView

# The semaphore keeps its GroupConfigState in this memo key, so that a run started after an operator terminated the
# last one can take the live overrides over (WorkflowOps.previous_group_config).
GROUP_CONFIG_MEMO: Final = "group_config"

# The EC2 tag that names an instance's capacity group, on replacements and on the simulated fleet.
GROUP_TAG: Final = "gpu-autorepair:group"
# The EC2 tag a reboot-first repair puts on the instance it rebooted (the reboot's token): a retried reboot step finds
# it and does not reboot twice, and an operator (or the simulated fleet) sees which repair rebooted it.
REBOOT_TAG: Final = "gpu-autorepair:reboot"
# The comment of the SSM Run Command a repair resets a GPU with: this, the instance id, the reset's token.
GPU_RESET_COMMENT: Final = "gpu-autorepair reset"
GATE_COMMENT: Final = "gpu-autorepair gate"
