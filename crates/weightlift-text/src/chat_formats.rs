//! llama-cpp-python's built-in chat formats (`Llama(chat_format="chatml")`), for models whose
//! checkpoint carries no chat template or the wrong one.
//!
//! Each format is a few constants (its system text, role prefixes, separators and stop string)
//! laid out by one of a handful of styles, the same layouts llama-cpp-python's formatters use;
//! [`ChatFormat::template`] writes them as a Jinja template, so a named format renders through
//! the one [`ChatTemplate`](crate::ChatTemplate) path every model template takes. As there:
//! - the system text is the first system message's content (`""` when there is none), put in
//!   the format's system wrapper, or the format's default when that content is empty;
//! - only the roles a format names are kept (a `tool` message is dropped);
//! - a message with empty content writes its role prefix alone;
//! - the prompt ends with the assistant's opening (but for `alpaca`, whose formatter does not
//!   add one), whatever `add_generation_prompt` says;
//! - the prompt is tokenized with BOS added by the vocabulary's rule, and the format's stop
//!   string joins the request's stop strings.
//!
//! `tests/data/chat_formats.json` holds llama-cpp-python's own prompts for each name
//! (`tests/gen_chat_formats.py`).

use crate::error::{Result, TextError};

/// How a format lays out its turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// `system + role + content + sep` per turn (role alone when empty).
    NoColon,
    /// `system + sep`, then `role: content sep` per turn (`role:` when empty).
    Colon,
    /// As [`Style::Colon`], the separators alternating between `sep` and `sep2`.
    ColonTwo,
    /// `system + sep + "\n"` (nothing when the system text is empty), then
    /// `role\ncontent sep\n` per turn (`role\n` when empty).
    ChatMl,
    /// `system`, then `role\n content` per turn (`role` when empty).
    Glm,
    /// Llama 2's `[INST]` layout: the system block only when there is a system message, and
    /// the first user turn folded into it.
    Llama2,
    /// Mistral's `[INST] user [/INST]assistant</s>` turns, no system text.
    MistralInstruct,
    /// Saiga's `<s>role\ncontent</s>` turns, then `<s>bot`, stripped.
    Saiga,
}

/// One built-in chat format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatFormat {
    /// The name `chat_format=` takes.
    pub name: &'static str,
    style: Style,
    /// The system text: `{}` stands for the first system message's content.
    system: &'static str,
    /// The content used when the first system message is missing or empty.
    default_system: &'static str,
    /// (message role, prefix) of each role the format keeps.
    roles: &'static [(&'static str, &'static str)],
    sep: &'static str,
    sep2: &'static str,
    /// Whether the prompt ends with the assistant's role prefix.
    opens_reply: bool,
    /// Ends the reply (joins the request's stop strings).
    pub stop: Option<&'static str>,
}

macro_rules! roles {
    ($user:expr, $assistant:expr) => {
        &[("user", $user), ("assistant", $assistant)]
    };
}

/// A format of `style` with no system text, roles or separators: what each entry fills in.
const fn base(name: &'static str, style: Style) -> ChatFormat {
    ChatFormat {
        name,
        style,
        system: "{}",
        default_system: "",
        roles: &[],
        sep: "",
        sep2: "",
        opens_reply: true,
        stop: None,
    }
}

/// Every built-in format, by name.
pub const CHAT_FORMATS: &[ChatFormat] = &[
    ChatFormat {
        system: "<|im_start|>system\n{}",
        roles: roles!("<|im_start|>user", "<|im_start|>assistant"),
        sep: "<|im_end|>",
        stop: Some("<|im_end|>"),
        ..base("chatml", Style::ChatMl)
    },
    ChatFormat {
        system: "<|im_start|>system\n{}",
        default_system: "You are a helpful assistant.",
        roles: roles!("<|im_start|>user", "<|im_start|>assistant"),
        sep: "<|im_end|>",
        stop: Some("<|endoftext|>"),
        ..base("qwen", Style::ChatMl)
    },
    ChatFormat {
        system: "[INST] <<SYS>>\n{}\n<</SYS>>",
        roles: roles!("<s>[INST]", "[/INST]"),
        sep: " ",
        sep2: "</s>",
        ..base("llama-2", Style::Llama2)
    },
    ChatFormat {
        system: "",
        roles: &[
            ("system", "<|start_header_id|>system<|end_header_id|>\n\n"),
            ("user", "<|start_header_id|>user<|end_header_id|>\n\n"),
            (
                "assistant",
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
            ),
        ],
        sep: "<|eot_id|>",
        stop: Some("<|eot_id|>"),
        ..base("llama-3", Style::NoColon)
    },
    ChatFormat {
        sep2: "</s>",
        stop: Some("</s>"),
        ..base("mistral-instruct", Style::MistralInstruct)
    },
    ChatFormat {
        system: "",
        roles: roles!("<start_of_turn>user\n", "<start_of_turn>model\n"),
        sep: "<end_of_turn>\n",
        stop: Some("<end_of_turn>\n"),
        ..base("gemma", Style::NoColon)
    },
    ChatFormat {
        system: "<|system|>\n{}",
        roles: roles!("<|user|>\n", "<|assistant|>\n"),
        sep: "</s>",
        stop: Some("</s>"),
        ..base("zephyr", Style::ChatMl)
    },
    ChatFormat {
        roles: roles!("### Instruction", "### Response"),
        sep: "\n\n",
        sep2: "</s>",
        opens_reply: false,
        ..base("alpaca", Style::ColonTwo)
    },
    ChatFormat {
        system: "A chat between a curious user and an artificial intelligence assistant. The \
                 assistant gives helpful, detailed, and polite answers to the user's questions.",
        roles: roles!("USER", "ASSISTANT"),
        sep: " ",
        sep2: "</s>",
        ..base("vicuna", Style::ColonTwo)
    },
    ChatFormat {
        system: "{}<|end_of_turn|>",
        roles: roles!(
            "GPT4 Correct User: ",
            "<|end_of_turn|>GPT4 Correct Assistant: "
        ),
        sep: "<|end_of_turn|>",
        stop: Some("<|end_of_turn|>"),
        ..base("openchat", Style::ChatMl)
    },
    ChatFormat {
        system: "<|system|>{}",
        roles: roles!("<|user|>", "<|model|>"),
        sep: "\n",
        stop: Some("\n"),
        ..base("pygmalion", Style::ChatMl)
    },
    ChatFormat {
        roles: roles!("<human>", "<bot>"),
        sep: "\n",
        stop: Some("<human>"),
        ..base("redpajama-incite", Style::Colon)
    },
    ChatFormat {
        default_system: "The prompt below is a question to answer, a task to complete, or a \
                         conversation to respond to; decide which and write an appropriate \
                         response.",
        roles: roles!("### Prompt", "### Response"),
        sep: "\n",
        stop: Some("###"),
        ..base("snoozy", Style::Colon)
    },
    ChatFormat {
        system: "<|system|>\n{}",
        roles: roles!("<|user|>", "<|assistant|>"),
        stop: Some("</s>"),
        ..base("chatglm3", Style::Glm)
    },
    ChatFormat {
        roles: roles!("<reserved_102>", "<reserved_103>"),
        ..base("baichuan", Style::NoColon)
    },
    ChatFormat {
        roles: roles!("<reserved_106>", "<reserved_107>"),
        ..base("baichuan-2", Style::NoColon)
    },
    ChatFormat {
        system: "[INST] <<SYS>>\n{}\n<</SYS>>\n\n",
        roles: roles!("<|prompter|>", "<|assistant|>"),
        sep: "</s>",
        ..base("oasst_llama", Style::NoColon)
    },
    ChatFormat {
        system: "<|system|>{}</s>",
        roles: roles!("<|prompter|>", "</s>\n<|assistant|>"),
        sep: " ",
        ..base("mistrallite", Style::NoColon)
    },
    ChatFormat {
        roles: &[("user", "user"), ("bot", "bot"), ("system", "system")],
        ..base("saiga", Style::Saiga)
    },
];

/// The built-in format called `name`; an unknown name is an error listing the known ones.
pub fn chat_format(name: &str) -> Result<&'static ChatFormat> {
    CHAT_FORMATS
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| TextError::Unsupported {
            what: "chat format",
            name: name.to_owned(),
            supported: CHAT_FORMATS
                .iter()
                .map(|f| f.name)
                .collect::<Vec<_>>()
                .join(", "),
            hint: "chat_format=None uses the model's own chat template",
        })
}

/// `s` as a Jinja string literal.
fn lit(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl ChatFormat {
    /// The format as a Jinja template over `messages` (rendered by
    /// [`ChatTemplate`](crate::ChatTemplate)).
    pub fn template(&self) -> String {
        let roles: Vec<String> = self
            .roles
            .iter()
            .map(|(r, p)| format!("{}: {}", lit(r), lit(p)))
            .collect();
        let kept: Vec<String> = self.roles.iter().map(|(r, _)| lit(r)).collect();
        // S: the first system message's content, or the default; SYS: S in the wrapper.
        let (before, after) = self.system.split_once("{}").unwrap_or((self.system, ""));
        let uses_content = self.system.contains("{}");
        let mut t = format!(
            "{{% set ns = namespace(found=false, content='') %}}\
             {{% for m in messages %}}{{% if m.role == 'system' and not ns.found %}}\
             {{% set ns.found = true %}}{{% set ns.content = m.content %}}{{% endif %}}\
             {{% endfor %}}\
             {{% set S = ns.content or {default} %}}\
             {{% set SYS = {before} ~ {content} ~ {after} %}}\
             {{% set R = {{{roles}}} %}}\
             {{% set SEP = {sep} %}}{{% set SEP2 = {sep2} %}}\
             {{% set turns = messages | selectattr('role', 'in', [{kept}]) | list %}}",
            default = lit(self.default_system),
            before = lit(before),
            content = if uses_content { "S" } else { "''" },
            after = lit(after),
            roles = roles.join(", "),
            sep = lit(self.sep),
            sep2 = lit(self.sep2),
            kept = kept.join(", "),
        );
        let reply = self
            .roles
            .iter()
            .find(|(r, _)| *r == "assistant")
            .map_or(String::new(), |(_, p)| lit(p));
        let body = match self.style {
            Style::NoColon => format!(
                "{{{{ SYS }}}}{{% for m in turns %}}{{% if m.content %}}\
                 {{{{ R[m.role] ~ m.content ~ SEP }}}}{{% else %}}{{{{ R[m.role] }}}}{{% endif %}}\
                 {{% endfor %}}{{{{ {reply} }}}}"
            ),
            Style::Colon => format!(
                "{{{{ SYS ~ SEP }}}}{{% for m in turns %}}{{% if m.content %}}\
                 {{{{ R[m.role] ~ ': ' ~ m.content ~ SEP }}}}{{% else %}}{{{{ R[m.role] ~ ':' }}}}\
                 {{% endif %}}{{% endfor %}}{{{{ {reply} ~ ':' }}}}"
            ),
            Style::ColonTwo => {
                let open = if self.opens_reply {
                    format!("{{{{ {reply} ~ ':' }}}}")
                } else {
                    String::new()
                };
                format!(
                    "{{{{ SYS ~ SEP }}}}{{% for m in turns %}}{{% if m.content %}}\
                     {{{{ R[m.role] ~ ': ' ~ m.content ~ (SEP if loop.index0 % 2 == 0 else SEP2) }}}}\
                     {{% else %}}{{{{ R[m.role] ~ ':' }}}}{{% endif %}}{{% endfor %}}{open}"
                )
            }
            Style::ChatMl => format!(
                "{{% if SYS %}}{{{{ SYS ~ SEP ~ '\\n' }}}}{{% endif %}}{{% for m in turns %}}\
                 {{% if m.content %}}{{{{ R[m.role] ~ '\\n' ~ m.content ~ SEP ~ '\\n' }}}}\
                 {{% else %}}{{{{ R[m.role] ~ '\\n' }}}}{{% endif %}}{{% endfor %}}\
                 {{{{ {reply} ~ '\\n' }}}}"
            ),
            Style::Glm => format!(
                "{{{{ SYS }}}}{{% for m in turns %}}{{% if m.content %}}\
                 {{{{ R[m.role] ~ '\\n ' ~ m.content }}}}{{% else %}}{{{{ R[m.role] }}}}\
                 {{% endif %}}{{% endfor %}}{{{{ {reply} }}}}"
            ),
            Style::Llama2 => "{% set SYS = SYS if ns.content else '' %}{{ SYS ~ ' ' }}\
                 {% for m in turns %}{% if SYS and loop.first %}{{ m.content ~ ' ' }}\
                 {% elif m.content %}{{ R[m.role] ~ m.content ~ ' ' ~ (SEP if loop.index0 % 2 == 0 \
                 else SEP2) }}{% else %}{{ R[m.role] ~ ' ' }}{% endif %}{% endfor %}[/INST]"
                .to_owned(),
            Style::MistralInstruct => "{% for m in messages %}{% if m.role == 'user' %}\
                 {{ '[INST] ' ~ m.content }}{% elif m.role == 'assistant' %}\
                 {{ ' [/INST]' ~ m.content ~ SEP2 }}{% endif %}{% endfor %} [/INST]"
                .to_owned(),
            Style::Saiga => "{% set ns2 = namespace(out='') %}{% for m in turns %}\
                 {% if m.content %}{% set ns2.out = ns2.out ~ '<s>' ~ R[m.role] ~ '\\n' ~ \
                 m.content ~ '</s>' %}{% else %}{% set ns2.out = ns2.out ~ '<s>' ~ R[m.role] ~ \
                 '\\n' %}{% endif %}{% endfor %}{{ (ns2.out ~ '<s>bot') | trim }}"
                .to_owned(),
        };
        t.push_str(&body);
        t
    }
}
