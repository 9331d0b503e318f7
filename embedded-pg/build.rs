//! `sqlx::migrate!` embeds `migrations/` at compile time; without this, adding a migration would
//! not rebuild the crate and the binary would silently carry the old set.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
