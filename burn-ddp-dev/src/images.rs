//! The classifier examples' images, without Burn (both Burn lines' examples use this file): a
//! generated "shapes" set (no download, the same on every machine), or MNIST from IDX files the
//! user points to.

use std::f32::consts::PI;
use std::path::Path;

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

/// MNIST from the four IDX files in `dir` (as distributed, after `gunzip`).
pub fn mnist(dir: &Path) -> Result<(Vec<Item>, Vec<Item>), String> {
    let load = |images: &str, labels_file: &str| -> Result<Vec<Item>, String> {
        let pixels = idx(&dir.join(images), 0x0803)?;
        let labels = idx(&dir.join(labels_file), 0x0801)?;
        let count = labels.len();
        if pixels.len() != count * SIDE * SIDE {
            return Err(format!(
                "{images} holds {} bytes of pixels, expected {count} images of {SIDE}×{SIDE} \
                 to match {labels_file}",
                pixels.len()
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

/// The payload of an IDX file whose magic number is `magic`.
fn idx(path: &Path, magic: u32) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| {
        let mut gz = path.as_os_str().to_owned();
        gz.push(".gz");
        let hint = if Path::new(&gz).exists() {
            " (only the .gz is there: run `gunzip` on it first)"
        } else {
            " (point --mnist at the directory holding the four uncompressed IDX files)"
        };
        format!("cannot read {}: {e}{hint}", path.display())
    })?;
    let header = |i: usize| -> Option<u32> {
        Some(u32::from_be_bytes(
            bytes.get(4 * i..4 * i + 4)?.try_into().ok()?,
        ))
    };
    let found =
        header(0).ok_or_else(|| format!("{} is too short for an IDX file", path.display()))?;
    if found != magic {
        return Err(format!(
            "{} is not an IDX file of the expected kind (magic {found:#010x}, expected {magic:#010x})",
            path.display()
        ));
    }
    let dims = (magic & 0xff) as usize;
    let start = 4 + 4 * dims;
    let count: usize = (1..=dims)
        .map(|i| header(i).map(|d| d as usize))
        .try_fold(1usize, |acc, d| d.map(|d| acc * d))
        .ok_or_else(|| format!("{} has a truncated header", path.display()))?;
    match bytes.get(start..start + count) {
        Some(data) => Ok(data.to_vec()),
        None => Err(format!(
            "{} is truncated: its header announces {count} values",
            path.display()
        )),
    }
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
