//! Damaged files a resume reads, for both Burn lines' classifier examples: a checkpoint cut
//! short, one with a byte changed, a run file that is not burn-ddp's. Each is refused on every
//! rank with an error naming the file and the fix, never a panic.

use std::path::Path;

use crate::spawned::small_run;

/// The classifier example `name` on 2 ranks, small ([`small_run`]): whether it succeeded, and
/// its stdout and stderr.
fn run(name: &str, out: &Path, args: &[&str]) -> (bool, String) {
    let (output, stdout, stderr) = small_run(name, out, &[&["--epochs", "1"], args].concat());
    (output.status.success(), format!("{stdout}{stderr}"))
}

/// The classifier example `name` writes the checkpoint of epoch 1; each damage in turn (the
/// model cut short, a byte of the optimizer changed, the run file replaced by text that is not
/// burn-ddp's) makes a resume fail on every rank, naming the file, what is wrong and the fix,
/// without a panic; the undamaged checkpoint then resumes.
pub fn damaged_checkpoints_are_refused(name: &str) {
    let out = std::env::temp_dir().join(format!("burn-ddp-damage-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let (ok, text) = run(name, &out, &[]);
    assert!(ok, "{text}");
    let dir = out.join("checkpoint");
    let keep = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let (model, optim) = (keep("model-1.bin"), keep("optim-1.bin"));
    let mut flipped = optim.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let cases: [(&str, Vec<u8>, &str, &str); 3] = [
        (
            "model-1.bin",
            model[..model.len() / 2].to_vec(),
            "it is truncated",
            "Resume from an earlier epoch",
        ),
        (
            "optim-1.bin",
            flipped,
            "it is corrupt",
            "Resume from an earlier epoch",
        ),
        (
            "run.txt",
            b"learning rate 0.002\n".to_vec(),
            "line 1 is not `key = value`",
            "start afresh",
        ),
    ];
    for (file, damaged, why, fix) in cases {
        let good = keep(file);
        std::fs::write(dir.join(file), damaged).unwrap();
        let (ok, text) = run(name, &out, &["--epochs", "2", "--resume"]);
        assert!(!ok, "{file}: the resume succeeded:\n{text}");
        assert!(!text.contains("panicked"), "{file}:\n{text}");
        for needle in [file, why, fix] {
            assert!(text.contains(needle), "{file}: no {needle:?} in:\n{text}");
        }
        std::fs::write(dir.join(file), good).unwrap();
    }
    let (ok, text) = run(name, &out, &["--epochs", "2", "--resume"]);
    assert!(ok, "{text}");
    let _ = std::fs::remove_dir_all(&out);
}
