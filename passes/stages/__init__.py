"""Pipeline stages: schedules as data (`schedules`), their picture and trace (`picture`),
and the SPMD loop of ticks that runs one (`executor`)."""
