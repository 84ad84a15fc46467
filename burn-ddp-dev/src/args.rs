//! The command line of the step benchmarks: `cargo bench` appends `--bench`; the rest are
//! `--rounds N` and, for benchmarks that have several parts, their names.

pub use burn_ddp_comm::launch::bench::median;

/// What a benchmark was asked to run.
pub struct Args {
    /// Rounds of interleaved measurements (default 5).
    pub rounds: usize,
    /// The parts named, in order (empty: the benchmark's default).
    pub names: Vec<String>,
}

/// Reads the process's arguments; `parts` are the names it accepts besides `--rounds N`.
///
/// # Errors
/// What is wrong with the arguments, and what is expected.
pub fn parse(parts: &[&str]) -> Result<Args, String> {
    let mut out = Args {
        rounds: 5,
        names: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--rounds" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) if n > 0 => out.rounds = n,
                _ => return Err("--rounds needs a positive number".into()),
            },
            name if parts.contains(&name) => out.names.push(a),
            other => {
                let mut expected: Vec<&str> = parts.to_vec();
                expected.push("--rounds N");
                return Err(format!(
                    "unknown argument {other}: expected {}",
                    expected.join(", ")
                ));
            }
        }
    }
    Ok(out)
}
