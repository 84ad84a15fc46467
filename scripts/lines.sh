# The Burn lines, as a user's project meets them (sourced by scripts/feature-check.sh and
# scripts/user-project-check.sh): each line's crate, the Burn release it is built on, the
# features such a project gives Burn for a CPU backend, and a program that uses the line. Burn 0.21's has `distributed` too, which
# the 0.21 line needs (the guide says to add it); Burn 0.23 has no NdArray, its CPU backend is Flex.
# shellcheck shell=bash
burn_lines=(burn-ddp burn-ddp-burn022 burn-ddp-burn023)

# line_release LINE: the Burn release of LINE (exit 1 for an unknown line).
line_release() {
    case $1 in
    burn-ddp) echo 0.21.0 ;;
    burn-ddp-burn022) echo 0.22.1 ;;
    burn-ddp-burn023) echo 0.23.0-pre.1 ;;
    *) return 1 ;;
    esac
}

# line_backend LINE: the CPU backend features of a Burn project on LINE's release.
line_backend() {
    case $1 in
    burn-ddp) echo '"ndarray", "distributed"' ;;
    burn-ddp-burn022) echo '"ndarray"' ;;
    burn-ddp-burn023) echo '"flex"' ;;
    *) return 1 ;;
    esac
}

# line_main LINE: a program that uses the line (its gradient sync's configuration and the Learner
# strategy's type), so that a check of the project reaches the line's code, not only its
# dependencies'.
line_main() {
    case $1 in
    burn-ddp)
        cat <<'EOF'
type B = burn::backend::Autodiff<burn_ddp::Ddp<burn::backend::NdArray>>;
fn main() {
    let _config = burn_ddp::DdpConfig::default();
    println!("{}", std::any::type_name::<burn_ddp::prelude::DdpStrategy<B>>());
}
EOF
        ;;
    burn-ddp-burn022 | burn-ddp-burn023)
        local krate=${1//-/_}
        cat <<EOF
fn main() {
    let _config = $krate::DdpConfig::default();
    println!("{} {}", std::any::type_name::<$krate::GradSync>(),
        std::any::type_name::<$krate::train::DdpStrategy>());
}
EOF
        ;;
    *) return 1 ;;
    esac
}

# compile_errors LOG: the errors of a cargo log, each with its notes (up to the blank line that
# ends it), the first 60 lines.
compile_errors() {
    awk '/^error/ { on = 1 } on { print } /^$/ { on = 0 }' "$1" | head -60
}
