//! Misuse of `#[ddp]` is a compile error that says what to do.

#[test]
fn misuse_is_a_helpful_compile_error() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
