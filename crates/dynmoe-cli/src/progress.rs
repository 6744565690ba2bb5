//! Progress display on stderr, shown only when stderr is a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

fn visible() -> bool {
    std::io::stderr().is_terminal()
}

/// A bar for a job whose length becomes known at the first update.
pub fn bar(label: &str) -> ProgressBar {
    if !visible() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(label.to_string());
    bar
}

/// Sets a bar's position and length.
pub fn update(bar: &ProgressBar, done: usize, total: usize) {
    bar.set_length(total as u64);
    bar.set_position(done as u64);
}

/// A spinner for work of unknown length.
pub fn spinner(label: &str) -> ProgressBar {
    if !visible() {
        return ProgressBar::hidden();
    }
    let s = ProgressBar::new_spinner();
    s.set_message(label.to_string());
    s.enable_steady_tick(std::time::Duration::from_millis(100));
    s
}
