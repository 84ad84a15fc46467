//! The classifier examples' images, without Burn (both Burn lines' examples use this file): a
//! generated "shapes" set (no download, the same on every machine), or MNIST from IDX files the
//! user points to.

use std::f32::consts::PI;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Image side, in pixels.
pub const SIDE: usize = 28;

/// One image (row-major, values in 0..=1) and its class.
#[derive(Debug, Clone)]
pub struct Item {
    pub pixels: Vec<f32>,
    pub label: usize,
}

// ------------------------------------------------------------------ shapes

/// Names of the generated classes.
pub const SHAPES: [&str; 4] = ["ring", "square", "triangle", "cross"];

/// `n` outlined shapes of random position, size, rotation and stroke, with noise; class `i % 4`
/// for item `i`. Deterministic in `seed`.
pub fn shapes(n: usize, seed: u64) -> Vec<Item> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let label = i % SHAPES.len();
            let cx = rng.random_range(10.0..18.0);
            let cy = rng.random_range(10.0..18.0);
            let r = rng.random_range(5.0..10.0);
            let rot = rng.random_range(0.0..2.0 * PI);
            let stroke = rng.random_range(0.8..1.8);
            let segments = outline(label, (cx, cy), r, rot);
            let pixels = (0..SIDE * SIDE)
                .map(|p| {
                    let (x, y) = ((p % SIDE) as f32 + 0.5, (p / SIDE) as f32 + 0.5);
                    let d = match &segments {
                        None => ((x - cx).hypot(y - cy) - r).abs(),
                        Some(segs) => segs
                            .iter()
                            .map(|&(a, b)| segment_distance((x, y), a, b))
                            .fold(f32::INFINITY, f32::min),
                    };
                    let ink = (1.0 - d / stroke).clamp(0.0, 1.0);
                    let noise: f32 = rng.random_range(-0.15..0.15);
                    (ink + noise).clamp(0.0, 1.0)
                })
                .collect();
            Item { pixels, label }
        })
        .collect()
}

type Point = (f32, f32);

/// The segments of a shape's outline (`None` for the ring, drawn from its equation).
fn outline(label: usize, c: Point, r: f32, rot: f32) -> Option<Vec<(Point, Point)>> {
    let at = |angle: f32, radius: f32| (c.0 + radius * angle.cos(), c.1 + radius * angle.sin());
    let polygon = |k: usize| {
        let v: Vec<Point> = (0..k)
            .map(|i| at(rot + 2.0 * PI * i as f32 / k as f32, r))
            .collect();
        (0..k).map(|i| (v[i], v[(i + 1) % k])).collect()
    };
    match label {
        0 => None,
        1 => Some(polygon(4)),
        2 => Some(polygon(3)),
        _ => Some(vec![
            (at(rot, r), at(rot + PI, r)),
            (at(rot + PI / 2.0, r), at(rot + 1.5 * PI, r)),
        ]),
    }
}

fn segment_distance(p: Point, a: Point, b: Point) -> f32 {
    let (abx, aby) = (b.0 - a.0, b.1 - a.1);
    let t = (((p.0 - a.0) * abx + (p.1 - a.1) * aby) / (abx * abx + aby * aby)).clamp(0.0, 1.0);
    (p.0 - (a.0 + t * abx)).hypot(p.1 - (a.1 + t * aby))
}

// ------------------------------------------------------------------- MNIST

/// MNIST's classes (digits).
pub const DIGITS: usize = 10;

/// MNIST from the four IDX files in `dir` (as distributed, after `gunzip`). Everything read is
/// checked (magic numbers, dimensions, sizes, labels) and refused naming the file and the fix.
pub fn mnist(dir: &Path) -> Result<(Vec<Item>, Vec<Item>), String> {
    let load = |images: &str, labels_file: &str| -> Result<Vec<Item>, String> {
        let read = |name: &str| read_file(&dir.join(name));
        let name = |f: &str| dir.join(f).display().to_string();
        let (pixels, shape) = idx(&read(images)?, 0x0803).map_err(|e| fix(&name(images), &e))?;
        let (labels, _) =
            idx(&read(labels_file)?, 0x0801).map_err(|e| fix(&name(labels_file), &e))?;
        if shape[1..] != [SIDE, SIDE] {
            return Err(fix(
                &name(images),
                &format!(
                    "its images are {}×{}, not MNIST's {SIDE}×{SIDE}",
                    shape[1], shape[2]
                ),
            ));
        }
        if shape[0] != labels.len() {
            return Err(fix(
                &name(images),
                &format!(
                    "it holds {} images and {labels_file} {} labels",
                    shape[0],
                    labels.len()
                ),
            ));
        }
        if let Some((i, l)) = labels
            .iter()
            .enumerate()
            .find(|(_, l)| usize::from(**l) >= DIGITS)
        {
            return Err(fix(
                &name(labels_file),
                &format!("label {l} of item {i} is not a digit (0 to 9)"),
            ));
        }
        Ok(pixels
            .chunks_exact(SIDE * SIDE)
            .zip(labels)
            .map(|(p, l)| Item {
                pixels: p.iter().map(|&v| f32::from(v) / 255.0).collect(),
                label: usize::from(l),
            })
            .collect())
    };
    Ok((
        load("train-images-idx3-ubyte", "train-labels-idx1-ubyte")?,
        load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?,
    ))
}

/// What is wrong with `file`, and what to do about it.
fn fix(file: &str, why: &str) -> String {
    format!(
        "{file}: {why}. --mnist needs the four uncompressed IDX files of MNIST as distributed \
         (download them again if they were damaged)"
    )
}

fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| {
        let mut gz = path.as_os_str().to_owned();
        gz.push(".gz");
        let hint = if Path::new(&gz).exists() {
            " (only the .gz is there: run `gunzip` on it first)"
        } else {
            " (point --mnist at the directory holding the four uncompressed IDX files)"
        };
        format!("cannot read {}: {e}{hint}", path.display())
    })
}

/// The payload and dimensions of the bytes of an IDX file of unsigned bytes whose magic number is
/// `magic` (its last byte is the number of dimensions); what is wrong with them otherwise.
pub fn idx(bytes: &[u8], magic: u32) -> Result<(Vec<u8>, Vec<usize>), String> {
    let header = |i: usize| -> Option<u32> {
        Some(u32::from_be_bytes(
            bytes.get(4 * i..4 * i + 4)?.try_into().ok()?,
        ))
    };
    let found = header(0).ok_or("it is too short for an IDX file")?;
    if found != magic {
        return Err(format!(
            "it is not an IDX file of the expected kind (magic number {found:#010x}, expected \
             {magic:#010x})"
        ));
    }
    let dims = (magic & 0xff) as usize;
    let shape: Vec<usize> = (1..=dims)
        .map(|i| header(i).map(|d| d as usize))
        .collect::<Option<_>>()
        .ok_or("its header is truncated")?;
    let count = shape
        .iter()
        .try_fold(1usize, |acc, d| acc.checked_mul(*d))
        .ok_or("its header announces more values than can exist")?;
    let start = 4 + 4 * dims;
    let held = bytes.len() - start.min(bytes.len());
    if held != count {
        return Err(format!(
            "its header announces {count} values ({}), the file holds {held}",
            shape
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(" × ")
        ));
    }
    Ok((bytes[start..].to_vec(), shape))
}

// ------------------------------------------------------------------ options

/// A count that must be at least 1 (`--epochs`, `--batch-size`, the data sizes).
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a whole number: {e}")),
    }
}

/// A finite number above 0 (`--lr`).
pub fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(x) => Err(format!("must be a finite number above 0, not {x}")),
        Err(e) => Err(format!("not a number: {e}")),
    }
}

/// What makes a checkpoint a run's (`DdpStrategy::with_run_settings`): the data, the batch
/// size, the learning rate and the seed. `sizes`: generated training and test images, batch size.
pub fn settings(
    mnist: Option<&Path>,
    (train, test, batch): (usize, usize, usize),
    lr: f64,
    seed: u64,
) -> [(&'static str, String); 4] {
    let data = match mnist {
        Some(dir) => format!("MNIST from {}", dir.display()),
        None => format!("generated shapes, {train} training / {test} test"),
    };
    [
        ("data", data),
        ("batch size", batch.to_string()),
        ("learning rate", lr.to_string()),
        ("seed", seed.to_string()),
    ]
}

/// The training and test sets must hold something, and every rank needs a training image.
pub fn check_sizes(train: usize, test: usize, world: usize) -> Result<(), String> {
    if train < world {
        return Err(format!(
            "{train} training images cannot be shared by {world} ranks: every rank needs at \
             least one (use more images, or fewer ranks)"
        ));
    }
    if test == 0 {
        return Err("the test set is empty: there is nothing to measure accuracy on".into());
    }
    Ok(())
}

// ------------------------------------------------------------------ pace

/// The classifier examples' `--min-step-ms`: a training step takes at least `period`, however
/// fast the machine, so that a run can be watched and a test's fault lands mid-epoch on an
/// optimised build as on a debug one. A step that is slower anyway is not delayed; a zero
/// period never waits. Its clones share one pace (a batcher is cloned with it).
#[derive(Debug, Clone, Default)]
pub struct Pace {
    period: Duration,
    last: Arc<Mutex<Option<Instant>>>,
}

impl Pace {
    /// At most one step per `period`.
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            last: Arc::default(),
        }
    }

    /// Waits until `period` has passed since the previous call returned (the first returns at
    /// once).
    pub fn wait(&self) {
        if self.period.is_zero() {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(due) = last.map(|at| at + self.period) {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        *last = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pace_spaces_its_steps_by_its_period_and_a_zero_one_never_waits() {
        let pace = Pace::new(Duration::from_millis(30));
        let start = Instant::now();
        for _ in 0..3 {
            pace.wait();
        }
        // Two periods at least between the first step and the third (sleep never wakes early).
        assert!(start.elapsed() >= Duration::from_millis(60));
        let none = Pace::default();
        for _ in 0..3 {
            none.wait();
        }
        assert!(
            none.last.lock().unwrap().is_none(),
            "a zero period recorded a step"
        );
    }

    /// The bytes of an IDX file of unsigned bytes with `shape` and `data`.
    fn idx_file(shape: &[u32], data: &[u8]) -> Vec<u8> {
        let mut bytes = (0x0800u32 | shape.len() as u32).to_be_bytes().to_vec();
        for d in shape {
            bytes.extend_from_slice(&d.to_be_bytes());
        }
        bytes.extend_from_slice(data);
        bytes
    }

    /// Where [`mnist_dir`] puts the files named `name`.
    fn mnist_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("burn-ddp-idx-{name}-{}", std::process::id()))
    }

    /// A directory of the four MNIST files: `n` images with these labels.
    fn mnist_dir(name: &str, labels: &[u8], side: u32) -> std::path::PathBuf {
        let dir = mnist_path(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let n = labels.len() as u32;
        let pixels = vec![7u8; (n * side * side) as usize];
        for (images, labels_file) in [
            ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        ] {
            std::fs::write(dir.join(images), idx_file(&[n, side, side], &pixels)).unwrap();
            std::fs::write(dir.join(labels_file), idx_file(&[n], labels)).unwrap();
        }
        dir
    }

    #[test]
    fn mnist_files_are_read_and_damage_is_named() {
        let dir = mnist_dir("good", &[0, 9, 3], SIDE as u32);
        let (train, test) = mnist(&dir).unwrap();
        assert_eq!((train.len(), test.len(), train[1].label), (3, 3, 9));
        let dir = mnist_dir("label", &[0, 12], SIDE as u32);
        let e = mnist(&dir).unwrap_err();
        assert!(
            e.contains("train-labels-idx1-ubyte: label 12 of item 1 is not a digit"),
            "{e}"
        );
        let dir = mnist_dir("side", &[1], 14);
        let e = mnist(&dir).unwrap_err();
        assert!(e.contains("its images are 14×14, not MNIST's 28×28"), "{e}");
        let dir = mnist_dir("count", &[1], SIDE as u32);
        std::fs::write(dir.join("train-labels-idx1-ubyte"), idx_file(&[2], &[1, 2])).unwrap();
        let e = mnist(&dir).unwrap_err();
        assert!(
            e.contains("it holds 1 images and train-labels-idx1-ubyte 2 labels"),
            "{e}"
        );
        assert!(e.contains("download them again"), "{e}");
        std::fs::write(dir.join("train-labels-idx1-ubyte"), [0u8, 0, 8, 1, 0xff]).unwrap();
        let e = mnist(&dir).unwrap_err();
        assert!(e.contains("its header is truncated"), "{e}");
        for name in ["good", "label", "side", "count"] {
            let _ = std::fs::remove_dir_all(mnist_path(name));
        }
    }

    proptest::proptest! {
        /// Any bytes are read or refused, never a panic (overflowing headers included); a
        /// well-formed file reads back.
        #[test]
        fn idx_reads_or_refuses_any_bytes(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
            dims in proptest::collection::vec(proptest::num::u32::ANY, 0..4),
            shape in proptest::collection::vec(0u32..5, 1..4),
        ) {
            let _ = idx(&bytes, 0x0803);
            let mut forged = (0x0800u32 | dims.len() as u32).to_be_bytes().to_vec();
            for d in &dims {
                forged.extend_from_slice(&d.to_be_bytes());
            }
            forged.extend_from_slice(&bytes);
            let _ = idx(&forged, 0x0800 | dims.len() as u32);
            let n: u32 = shape.iter().product();
            let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let magic = 0x0800 | shape.len() as u32;
            let (got, dims) = idx(&idx_file(&shape, &data), magic).unwrap();
            proptest::prop_assert_eq!(got, data);
            proptest::prop_assert_eq!(dims, shape.iter().map(|d| *d as usize).collect::<Vec<_>>());
        }
    }
}
