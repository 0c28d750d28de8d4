//! Placement planning as a pure function: (spec, tensor sizes, devices, cache, runtime) -> Plan.
