"""Pipeline parallelism: the GPT cut into stages (stage.py), schedules as data with a checker
(schedule.py), the executor that runs a schedule and records it (executor.py), and the measured
timeline, bubble and picture (timeline.py). Composed with tp and dp in parallel/hybrid.py."""
