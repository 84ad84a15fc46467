#![no_main]

use libfuzzer_sys::fuzz_target;

// Heartbeats read from the store, and the metric items ranks send to rank 0.
fuzz_target!(|data: &[u8]| {
    burn_ddp_comm::fuzzing::heartbeat(data);
    burn_ddp_comm::fuzzing::output_items(data);
});
