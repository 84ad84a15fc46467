# The Burn releases burn-ddp serves, as a user's project meets them (sourced by
# scripts/feature-check.sh and scripts/user-project-check.sh): each release's name (the feature of
# `burn-ddp` that chooses it), the Burn release, the features such a project gives Burn for a CPU
# backend, the `burn-ddp` dependency the README gives for it, and a program that uses it. Burn
# 0.21's has `distributed` too, which the 0.21 line needs (the guide says to add it); Burn 0.23
# has no NdArray, its CPU backend is Flex.
# shellcheck shell=bash
burn_lines=(burn-0-21 burn-0-22 burn-0-23)

# line_release LINE: the Burn release of LINE (exit 1 for an unknown line).
line_release() {
    case $1 in
    burn-0-21) echo 0.21.0 ;;
    burn-0-22) echo 0.22.1 ;;
    burn-0-23) echo 0.23.0-pre.1 ;;
    *) return 1 ;;
    esac
}

# line_backend LINE: the CPU backend features of a Burn project on LINE's release.
line_backend() {
    case $1 in
    burn-0-21) echo '"ndarray", "distributed"' ;;
    burn-0-22) echo '"ndarray"' ;;
    burn-0-23) echo '"flex"' ;;
    *) return 1 ;;
    esac
}

# line_dependency LINE ROOT [EXTRA_FEATURE]: the `burn-ddp` line of a project's Cargo.toml for
# LINE, by path to the repository at ROOT, as the README writes it: Burn 0.22.1 is the default
# release; another turns the defaults off and names its release with the two other defaults.
line_dependency() {
    local extra=""
    [ -z "${3:-}" ] || extra=", \"$3\""
    case $1 in
    burn-0-22)
        if [ -n "${3:-}" ]; then
            printf 'burn-ddp = { path = "%s/burn-ddp", features = ["%s"] }\n' "$2" "$3"
        else
            printf 'burn-ddp = { path = "%s/burn-ddp" }\n' "$2"
        fi
        ;;
    burn-0-21 | burn-0-23)
        printf 'burn-ddp = { path = "%s/burn-ddp", default-features = false, features = ["%s", "train", "hold-systemstat"%s] }\n' \
            "$2" "$1" "$extra"
        ;;
    *) return 1 ;;
    esac
}

# line_main LINE: a program that uses burn-ddp on LINE's release (its gradient sync's
# configuration and the Learner strategy's type), so that a check of the project reaches the
# line's code, not only its dependencies'. Burn 0.22's and 0.23's are one source.
line_main() {
    case $1 in
    burn-0-21)
        cat <<'EOF'
type B = burn::backend::Autodiff<burn_ddp::Ddp<burn::backend::NdArray>>;
fn main() {
    let _config = burn_ddp::DdpConfig::default();
    println!("{}", std::any::type_name::<burn_ddp::prelude::DdpStrategy<B>>());
}
EOF
        ;;
    burn-0-22 | burn-0-23)
        cat <<'EOF'
fn main() {
    let _config = burn_ddp::DdpConfig::default();
    println!("{} {}", std::any::type_name::<burn_ddp::GradSync>(),
        std::any::type_name::<burn_ddp::train::DdpStrategy>());
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
