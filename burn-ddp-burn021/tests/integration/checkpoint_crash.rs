//! A process killed (SIGKILL) while it writes checkpoints never leaves a torn one: the file on
//! disk always loads, and holds one complete version.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use burn::backend::NdArray;
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::Tensor;
use burn_ddp::checkpoint::{load_module, save_module, write_atomic};
use burn_ddp_dev::procs::rerun_args;

type B = NdArray;

const CHILD: &str = "BURN_DDP_CRASH_WRITER";

/// A 1024×1024 layer (4 MiB of weights) whose every weight is `v`.
fn model(v: f32) -> Linear<B> {
    let device = Default::default();
    let mut l = LinearConfig::new(1024, 1024)
        .with_bias(false)
        .init::<B>(&device);
    l.weight = Param::from_tensor(Tensor::full([1024, 1024], v, &device));
    l
}

fn path() -> PathBuf {
    PathBuf::from(std::env::var_os(CHILD).unwrap()).join("latest.bin")
}

#[test]
fn killed_writer_leaves_a_loadable_checkpoint() {
    if std::env::var_os(CHILD).is_some() {
        // The writer: saves version 1 with `save_module`, then overwrites it with versions 2
        // and 3 alternately, as fast as it can (records serialised once, so nearly all its
        // time is spent writing, flushing and renaming) until killed.
        save_module(&model(1.0), &path()).unwrap();
        let record = |v: f32| {
            BinBytesRecorder::<FullPrecisionSettings>::default()
                .record(model(v).into_record(), ())
                .unwrap()
        };
        let versions = [record(2.0), record(3.0)];
        for i in 0.. {
            write_atomic(&path(), &versions[i % 2]).unwrap();
        }
        return;
    }
    let dir = std::env::temp_dir().join(format!("burn-ddp-crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut seen = Vec::new();
    let mut torn = 0;
    // Until a kill has landed after an overwrite and one has interrupted a write (the writer
    // spends nearly all its time writing and flushing, so both come within a few rounds), and
    // at least 6 rounds.
    let mut round = 0u64;
    while round < 6 || !(torn > 0 && seen.iter().any(|v| *v > 1.0)) {
        assert!(
            round < 40,
            "after 40 kills: versions {seen:?}, {torn} kills during a write; the test did not \
             see both an overwrite and an interrupted write"
        );
        let mut child = Command::new(&exe)
            .args(rerun_args("killed_writer_leaves_a_loadable_checkpoint"))
            .env(CHILD, &dir)
            .spawn()
            .unwrap();
        // Let it write a few versions, then kill it at a different point each round.
        let file = dir.join("latest.bin");
        let start = std::time::Instant::now();
        while !file.exists() && start.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(300 + 53 * round));
        child.kill().unwrap();
        child.wait().unwrap();

        let loaded = load_module(model(0.0), &file, &Default::default())
            .unwrap_or_else(|e| panic!("round {round}: the checkpoint does not load: {e}"));
        let w: Vec<f32> = loaded.weight.val().into_data().to_vec().unwrap();
        let v = w[0];
        assert!(v >= 1.0, "round {round}: version {v}");
        assert!(
            w.iter().all(|x| *x == v),
            "round {round}: the checkpoint mixes versions"
        );
        seen.push(v);
        let temporaries: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect();
        // A killed writer may leave its temporary behind; it is never mistaken for the
        // checkpoint, and the next write removes it.
        torn += usize::from(!temporaries.is_empty());
        for t in temporaries {
            std::fs::remove_file(dir.join(t)).unwrap();
        }
        round += 1;
    }
    println!(
        "versions found after each kill: {seen:?}; kills that interrupted a write: {torn} of {round}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
