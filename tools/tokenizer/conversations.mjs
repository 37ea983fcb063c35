// Chat-template test inputs: conversations for the real Qwen3 template and for a
// Qwen3.5-style template (XML tool calls, macros, mapping tests), plus small
// templates that exercise one language feature each. Deterministic (seeded).
import { mulberry32 } from "./corpus.mjs";

// Written in the style of the Qwen3-Coder / Qwen3.5 templates (not a copy).
const QWEN35_STYLE = String.raw`{%- macro render_extra_keys(json_dict, handled_keys) -%}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro -%}
{%- set image_count = namespace(value=0) %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- '<|im_start|>system\n' }}
    {%- if system_message is defined %}{{- system_message.rstrip() + '\n\n' }}{%- endif %}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}{{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}{%- endif %}
        {{- '\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\n<parameter>\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}{{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}{%- endif %}
                {%- if param_fields.description is defined %}{{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}{%- endif %}
                {{- render_extra_keys(param_fields, ['name', 'type', 'description']) }}
                {{- '\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {{- render_extra_keys(tool.parameters, ['type', 'properties']) }}
        {{- '\n</parameters>' }}
        {{- render_extra_keys(tool, ['type', 'name', 'description', 'parameters']) }}
        {{- '\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '<|im_end|>\n' }}
{%- elif system_message is defined %}
    {{- '<|im_start|>system\n' ~ system_message ~ '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.reasoning_content is string and message.reasoning_content | length > 0 and loop.last %}
            {{- '\n<think>\n' ~ message.reasoning_content.strip('\n') ~ '\n</think>\n' }}
        {%- endif %}
        {%- if content | trim | length > 0 %}{{- '\n' ~ content | trim }}{%- endif %}
        {%- if message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '\n<tool_call>\n<function=' ~ tool_call.name ~ '>\n' }}
                {%- if tool_call.arguments is defined and tool_call.arguments is mapping %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' ~ args_name ~ '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value ~ '\n</parameter>\n' }}
                    {%- endfor %}
                {%- elif tool_call.arguments is string %}
                    {{- tool_call.arguments ~ '\n' }}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem is not defined or loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ content ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
`;

// One feature each; rendered with SNIPPET_CONTEXT.
const SNIPPETS = [
  "{{ 'abc'[::-1] }}|{{ [1,2,3,4,5][1:4] }}|{{ [1,2,3,4,5][::2] }}|{{ 'hello'[1:-1] }}|{{ [1,2,3][-1] }}",
  "{% for x in items %}{{ loop.index }}/{{ loop.length }}:{{ x }}{% if not loop.last %}, {% endif %}{% endfor %}",
  "{% for x in items if x > 2 %}{{ loop.index0 }}={{ x }};{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}",
  "{% for k, v in obj.items() %}{{ k }}={{ v }};{% endfor %}|{% for k in obj %}{{ k }}{% endfor %}",
  "{{ obj | tojson }}|{{ obj | tojson(indent=2) }}|{{ items | tojson }}|{{ 'a\"b\\n' | tojson }}",
  "{{ '  x  ' | trim }}|{{ ' x '.strip() }}|{{ '\\n\\nA\\n'.lstrip('\\n') }}|{{ 'ab  '.rstrip() }}",
  "{{ 'a,b,,c'.split(',') }}|{{ 'a b  c'.split() }}|{{ 'a-b-c'.split('-', 1) }}|{{ 'x</think>y'.split('</think>')[-1] }}",
  "{{ 'Hello'.upper() }}{{ 'Hello'.lower() }}{{ 'hello world'.title() }}{{ 'aXa'.replace('a', 'b') }}",
  "{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ 'abc'.startswith('c') }}{{ 'b' in 'abc' }}{{ 'z' not in 'abc' }}",
  "{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ 7 % 3 }}|{{ 2 ** 10 }}|{{ 7 / 2 }}|{{ -3 + 1 }}|{{ 1.5 + 1 }}|{{ 10 - 2 - 3 }}",
  "{{ 1 < 2 }}{{ 2 <= 1 }}{{ 'a' == 'a' }}{{ 1 != 1 }}{{ none is none }}{{ x is defined }}{{ undefined_var is defined }}",
  "{{ 'a' ~ 1 ~ 'b' }}|{{ 'n' + 'm' }}|{{ [1] + [2] }}|{{ true and 'yes' }}|{{ false or 'fallback' }}|{{ not true }}",
  "{{ 'yes' if flag else 'no' }}|{{ 'yes' if not flag else 'no' }}|{{ ('a' if false) }}|end",
  "{% set ns = namespace(count=0, found=false) %}{% for x in items %}{% set ns.count = ns.count + x %}{% endfor %}{{ ns.count }}{{ ns.found }}",
  "{% set a = 1 %}{% for x in items %}{% set a = x %}{% endfor %}{{ a }}|{% set b, c = [1, 2] %}{{ b }}{{ c }}",
  "{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}{% endmacro %}{{ greet('Bob') }} {{ greet('Al', punct='?') }} {{ greet(name='Cy') }}",
  "{{ items | length }}|{{ 'héllo' | length }}|{{ obj | length }}|{{ items | first }}|{{ items | last }}|{{ items | join('-') }}",
  "{{ missing | default('dflt') }}|{{ '' | default('e', true) }}|{{ 0 | default(5) }}|{{ none | default('n') }}",
  "{{ users | map(attribute='name') | join(', ') }}|{{ users | selectattr('admin') | map(attribute='name') | list }}",
  "{{ users | rejectattr('admin') | list | length }}|{{ users | selectattr('name', 'equalto', 'bob') | list | length }}",
  "{{ items | reverse | list }}|{{ [3,1,2] | sort }}|{{ ['b','a'] | sort | join }}|{{ [1,2,2,3] | unique | list }}",
  "{{ -5 | abs }}|{{ '42' | int + 1 }}|{{ 3.7 | int }}|{{ 2 | float }}",
  "{% if x is string %}s{% elif x is number %}n{% elif x is mapping %}m{% else %}o{% endif %}|{{ obj is mapping }}|{{ items is iterable }}",
  "{{ 3 is odd }}{{ 4 is even }}{{ x is integer }}{{ true is boolean }}",
  "{%- for m in messages -%}\n  {{ m.role }}: {{ m.content }}\n{% endfor -%}\nend",
  "  {% if true %}\n    indented\n  {% endif %}\n{# comment #}\nafter\n",
  "a  {{- ' b ' -}}  c {#- gone -#} d\n{%- if true %} e {% endif -%}\n f",
  "{{ obj.name }}|{{ obj['name'] }}|{{ obj.missing }}|{{ obj.get('name') }}|{{ obj.get('missing', 'dflt') }}|{{ obj.keys() | list }}",
  "{% for i in range(3) %}{{ i }}{% endfor %}|{% for i in range(1, 7, 2) %}{{ i }}{% endfor %}|{{ range(5) | list | length }}",
  "{% for x in items %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
  "{% set s %}block {{ 1 + 1 }}{% endset %}[{{ s }}]|{{ {'a': 1, 'b': [1, 2]} | tojson }}|{{ (1, 2) | length }}",
  "{{ '{' }}{{ '}}' }}|{{ 'it\\'s' }}|{{ \"dq\" }}|{{ 'tab\\there' }}",
  "{%- for m in messages %}{{ loop.previtem.role if loop.previtem is defined else '^' }}>{{ m.role }}<{{ loop.nextitem.role if loop.nextitem is defined else '$' }} {% endfor %}",
  "{{ obj | items | list | length }}|{{ obj | dictsort | first }}",
  "{{ '%s' }}|{{ 'a.b.c'.split('.') | join('/') }}|{{ messages[1:] | length }}|{{ messages[0]['role'] }}",
];

const SNIPPET_CONTEXT = {
  items: [1, 2, 3, 4, 5],
  obj: { name: "widget", size: 3, tags: ["a", "b"] },
  users: [{ name: "ann", admin: true }, { name: "bob", admin: false }, { name: "cy", admin: true }],
  x: 7,
  flag: true,
  messages: [{ role: "system", content: "sys" }, { role: "user", content: "hi" }, { role: "assistant", content: "yo" }],
};

export const TEMPLATES = { qwen35_style: QWEN35_STYLE };
SNIPPETS.forEach((s, i) => (TEMPLATES[`snippet_${String(i).padStart(2, "0")}`] = s));

const WEATHER_TOOL = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Get the current weather in a city. ",
    parameters: {
      type: "object",
      properties: {
        city: { type: "string", description: "City name, e.g. Paris" },
        unit: { type: "string", enum: ["celsius", "fahrenheit"] },
      },
      required: ["city"],
    },
  },
};
const SEARCH_TOOL = {
  type: "function",
  function: {
    name: "search",
    description: "Search the web",
    parameters: { type: "object", properties: { query: { type: "string" }, top_k: { type: "integer", default: 5 } } },
  },
};

const TEXTS = [
  "Hello!", "What is the capital of France?", "写一首关于秋天的诗。", "Объясни квантовую запутанность.",
  "def f(x):\n    return x * 2\n", "  leading and trailing spaces  ", "line1\n\nline2\n", "emoji 👨‍👩‍👧 test 🇯🇵",
  "Quotes: \"double\" and 'single' and `back`", "<b>html</b> & entities &amp;", "مرحبا بالعالم", "",
  "{{ not a template }} {% neither %}", "Tabs\tand\\backslashes\\n", "The answer is 42.",
];

function pick(rng, list) {
  return list[Math.floor(rng() * list.length)];
}

function tool_call(rng, style) {
  const args = rng() < 0.5 ? { city: pick(rng, ["Paris", "東京", "New \"York\""]), unit: "celsius" } : { query: pick(rng, TEXTS), top_k: 3 };
  const name = "city" in args ? "get_weather" : "search";
  const argument_value = style === "string" ? JSON.stringify(args) : args;
  return rng() < 0.8 ? { type: "function", function: { name, arguments: argument_value } } : { name, arguments: argument_value };
}

function random_conversation(rng) {
  const messages = [];
  if (rng() < 0.5) messages.push({ role: "system", content: pick(rng, ["You are a helpful assistant.", "Be terse.", "系统提示"]) });
  const turns = 1 + Math.floor(rng() * 4);
  for (let t = 0; t < turns; ++t) {
    messages.push({ role: "user", content: pick(rng, TEXTS) });
    if (t === turns - 1 && rng() < 0.5) break;  // ends on a user turn
    const assistant = { role: "assistant", content: pick(rng, TEXTS) };
    const r = rng();
    if (r < 0.25) assistant.reasoning_content = pick(rng, ["Let me think.", "\nStep 1\nStep 2\n", "思考中"]);
    else if (r < 0.4) assistant.content = "<think>\ninline reasoning\n</think>\n\n" + assistant.content;
    if (rng() < 0.4) {
      const style = rng() < 0.5 ? "string" : "object";
      assistant.tool_calls = [tool_call(rng, style)];
      if (rng() < 0.3) assistant.tool_calls.push(tool_call(rng, style));
      if (rng() < 0.3) assistant.content = "";
      messages.push(assistant);
      for (let k = 0; k < assistant.tool_calls.length; ++k) {
        messages.push({ role: "tool", content: pick(rng, ["{\"temp\": 21}", "sunny", "no results", "<tool_response>x</tool_response>"]) });
      }
      if (rng() < 0.5) messages.push({ role: "assistant", content: pick(rng, TEXTS) });
    } else {
      messages.push(assistant);
    }
  }
  const context = { messages, add_generation_prompt: rng() < 0.7, bos_token: "", eos_token: "<|im_end|>" };
  if (rng() < 0.45) context.tools = rng() < 0.5 ? [WEATHER_TOOL] : [WEATHER_TOOL, SEARCH_TOOL];
  const thinking = rng();
  if (thinking < 0.33) context.enable_thinking = false;
  else if (thinking < 0.66) context.enable_thinking = true;
  return context;
}

// The contexts to render `template_name` with.
export function make_conversations(template_name) {
  if (template_name.startsWith("snippet_")) return [SNIPPET_CONTEXT];
  const rng = mulberry32(template_name === "qwen3" ? 11 : 12);
  const out = [];
  const count = template_name === "qwen3" ? 80 : 40;
  for (let i = 0; i < count; ++i) out.push(random_conversation(rng));
  return out;
}
