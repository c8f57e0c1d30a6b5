"""Pipeline parallelism: the GPT cut into stages (stage.py), schedules as data with a checker
(schedule.py), the executor that runs a schedule and records it (executor.py), and the measured
timeline, bubble and picture (timeline.py), and the driver that runs a step on this rank's stage
and hands its gradients to the data-parallel component (driver.py; parallel/compose.py builds
both)."""
