"""tf.distribute's surface: the `Strategy` base, `extended`, `merge_call`, distributed
values and the cross-device ops. Imports step and everything below it."""
